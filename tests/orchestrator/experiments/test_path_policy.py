"""Path policy: engine arguments that name server files, folders or code (issue #13).

The argument set is derived from the real vLLM 0.32.0 catalogue; refusals name the
argument, the value and the setting to change; inline values (a Jinja template, a
Hugging Face id) stay accepted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from orchestrator.core.errors import SpecInvalidError
from orchestrator.core.settings import EngineSettings, PathSettings, Settings
from orchestrator.experiments.engine_catalog import EngineArgCatalog, load_catalog
from orchestrator.experiments.pathpolicy import ROOTS_SETTING, PathPolicy, path_like_args
from orchestrator.experiments.planner import plan_experiment
from orchestrator.experiments.spec import ExperimentSpec
from tests.factories import DATA, real_catalog

#: What the rule (plus the explicit list) finds in vLLM 0.32.0's ``vllm serve`` arguments.
EXPECTED = {
    # files and folders
    "chat_template": {"template_or_path"},
    "ssl_keyfile": {"path"},
    "ssl_certfile": {"path"},
    "ssl_ca_certs": {"path"},
    "allowed_local_media_path": {"path"},
    "generation_config": {"path"},
    "download_dir": {"path"},
    "mm_encoder_fp8_scale_path": {"path"},
    "mm_encoder_fp8_scale_save_path": {"path"},
    "default_mm_loras": {"path"},
    "log_config_file": {"path"},
    "config": {"path"},  # also reserved
    "uds": {"path"},  # also reserved
    "lora_modules": {"lora_modules"},
    # names or paths
    "model": {"name_or_path"},  # reserved: the experiment's model
    "tokenizer": {"name_or_path"},
    "hf_config_path": {"name_or_path"},
    "spec_model": {"name_or_path"},
    # code
    "trust_remote_code": {"code"},
    "middleware": {"code"},
    "model_class_overrides": {"code"},
    "logits_processors": {"code"},
    "io_processor_plugin": {"code"},
    "worker_cls": {"code"},
    "worker_extension_cls": {"code"},
    "scheduler_cls": {"code"},
    "tool_server": {"code"},
    "tool_parser_plugin": {"code", "path"},
    "reasoning_parser_plugin": {"code", "path"},
}


def catalog(roots: list[Path] | None = None, code: bool = False) -> EngineArgCatalog:
    return real_catalog().with_policy(PathPolicy.of(roots or [], code))


def problems(cat: EngineArgCatalog, **args: Any) -> list[dict[str, Any]]:
    return cat.check(args, ["body", "baseline", "engine_args"])


def test_the_path_like_set_is_derived_from_vllms_metadata() -> None:
    doc = json.loads((DATA / "engine_args_vllm032cpu.json").read_text())
    table = path_like_args({a["dest"]: a for a in doc["args"]})
    assert {k: set(v.kinds) for k, v in table.items()} == EXPECTED
    # URL paths and remote files are not server files
    assert "root_path" not in table and "hf_token" not in table
    assert "disable_access_log_for_endpoints" not in table and "quantization" not in table


def test_a_new_file_argument_is_caught_by_the_rule() -> None:
    cat = EngineArgCatalog.from_doc(
        {
            "vllm_version": "9.9",
            "args": [
                {"dest": "kv_dump_dir", "type": "str", "help": "Where to dump."},
                {"dest": "prompt_source", "type": "str", "help": "The file path to a prompt."},
                {"dest": "flag", "is_bool_flag": True, "help": "Write the file."},
            ],
        }
    )
    assert set(cat.path_args) == {"kv_dump_dir", "prompt_source"}
    assert [e["type"] for e in cat.check({"kv_dump_dir": "/"}, [])] == ["path_not_allowed"]


def test_server_files_are_refused_naming_argument_value_and_setting() -> None:
    cat = catalog()
    (err,) = problems(cat, chat_template="/etc/passwd")
    assert err["type"] == "path_not_allowed"
    assert err["loc"] == ["body", "baseline", "engine_args", "chat_template"]
    assert "chat_template" in err["msg"] and "'/etc/passwd'" in err["msg"]
    assert ROOTS_SETTING in err["msg"]
    for name, value in [
        ("download_dir", "/"),
        ("tokenizer", "/etc"),
        ("tokenizer", "../../etc"),
        ("tokenizer", "~/.ssh"),
        ("hf_config_path", "a/b/c"),
        ("allowed_local_media_path", "/"),
        ("ssl_keyfile", "/etc/ssl/private/key.pem"),
        ("generation_config", "/etc"),
        ("mm_encoder_fp8_scale_save_path", "/etc/cron.d/x"),
        ("log_config_file", "/etc/shadow"),
        ("lora_modules", ["adapter=/etc"]),
        ("default_mm_loras", {"image": "/root"}),
    ]:
        assert [e["type"] for e in problems(cat, **{name: value})] == ["path_not_allowed"], name


@pytest.mark.parametrize(
    ("name", "value", "kind"),
    [
        ("chat_template", "file:///etc/passwd", "a file: URI, not a path"),
        ("chat_template", "FILE:/etc/passwd", "a file: URI, not a path"),
        ("tokenizer", "https://example.com/tok", "a URL (https://), not a path"),
        ("download_dir", "s3://bucket/cache", "a URL (s3://), not a path"),
        ("lora_modules", ["sql=file:///etc"], "a file: URI, not a path"),
        ("download_dir", "C:\\models", "a Windows drive path"),
        ("tokenizer", "~/.ssh", "a path in a home folder"),
        ("download_dir", "cache", "a relative path"),
        ("hf_config_path", "a/b/c", "a relative path"),
        ("tokenizer", "../../etc", "a relative path"),
        ("chat_template", "/etc/passwd", "an absolute path, and no folder is allowed"),
    ],
)
def test_a_refusal_names_what_the_value_is(name: str, value: Any, kind: str) -> None:
    """``file:///etc/passwd`` was called "a relative path" (issue 23): each refusal now
    says what the value is: a file: URI, a URL, a Windows drive path, a path in a home
    folder, a relative or an absolute path."""
    (err,) = problems(catalog(), **{name: value})
    assert err["type"] == "path_not_allowed"
    assert f"refused: {kind}" in err["msg"], err["msg"]


def test_an_absolute_path_outside_the_roots_is_named_so(tmp_path: Path) -> None:
    (err,) = problems(catalog([tmp_path]), download_dir="/etc")
    assert "refused: an absolute path outside the allowed roots" in err["msg"]
    (err,) = problems(catalog([tmp_path]), chat_template="file://" + str(tmp_path / "t.jinja"))
    assert "refused: a file: URI, not a path" in err["msg"]  # even when its path is allowed


def test_values_that_are_not_paths_stay_accepted() -> None:
    cat = catalog()
    for name, value in [
        ("chat_template", "{% for m in messages %}{{ m.content }}{% endfor %}"),
        ("chat_template", "{{ messages[0].content }}"),
        ("chat_template", "template_chatml.jinja"),  # one of vLLM's built-in templates
        ("tokenizer", "Qwen/Qwen2.5-7B-Instruct"),
        ("tokenizer", "gpt2"),
        ("hf_config_path", "meta-llama/Llama-3.1-8B"),
        ("generation_config", "vllm"),
        ("generation_config", "auto"),
        ("lora_modules", ["sql=org/sql-lora"]),
        ("speculative_config", {"method": "ngram", "num_speculative_tokens": 3}),
        ("speculative_config", {"model": "org/draft", "num_speculative_tokens": 3}),
        ("compilation_config", {"mode": 0}),
        ("root_path", "/vllm"),  # a URL prefix, not a file
        ("trust_remote_code", False),
        ("worker_cls", "auto"),  # vLLM's default
    ]:
        assert problems(cat, **{name: value}) == [], (name, value)


def test_paths_under_an_allowed_root_are_accepted(tmp_path: Path) -> None:
    root = tmp_path / "models"
    (root / "tok").mkdir(parents=True)
    cat = catalog([root])
    assert problems(cat, chat_template=str(root / "chat.jinja")) == []
    assert problems(cat, tokenizer=str(root / "tok")) == []
    assert problems(cat, download_dir=str(root / "cache")) == []
    assert problems(cat, speculative_config={"model": str(root / "draft")}) == []
    # .. folded, and a link out of the root followed
    assert problems(cat, download_dir=f"{root}/../../etc")[0]["type"] == "path_not_allowed"
    (root / "escape").symlink_to("/etc")
    (err,) = problems(cat, tokenizer=str(root / "escape"))
    assert "symbolic link" in err["msg"]
    # a sibling whose name starts like the root is not under it
    assert problems(cat, download_dir=f"{root}-evil")[0]["type"] == "path_not_allowed"
    # relative paths resolve against the engine's working directory: refused
    assert "relative" in problems(cat, download_dir="cache")[0]["msg"]


def test_objects_inside_json_arguments_are_walked() -> None:
    cat = catalog()
    for name, value in [
        ("speculative_config", {"model": "/etc", "num_speculative_tokens": 2}),
        ("speculative_config", '{"model": "/etc"}'),  # JSON text, as vLLM accepts it
        ("compilation_config", {"debug_dump_path": "/etc"}),
        ("compilation_config", {"cache_dir": "/"}),
        ("profiler_config", {"torch_profiler_dir": "/tmp/x"}),
        ("lora_modules", ['{"name": "a", "path": "/etc"}']),
    ]:
        assert [e["type"] for e in problems(cat, **{name: value})] == ["path_not_allowed"], name
    (err,) = problems(cat, speculative_config={"model": "/etc"})
    assert "speculative_config.model" in err["msg"]


def test_code_is_refused_unless_allowed() -> None:
    for name, value in [
        ("trust_remote_code", True),
        ("worker_cls", "my.Worker"),
        ("middleware", ["my.app:mw"]),
        ("logits_processors", ["pkg.Processor"]),
        ("tool_server", "demo"),
        ("speculative_config", {"model": "pkg.MyProposer"}),
        ("kv_transfer_config", {"kv_connector_module_path": "evil.mod"}),
    ]:
        (err,) = problems(catalog(), **{name: value})
        assert err["type"] == "code_not_allowed", name
        assert "VLAB_PATHS__ALLOW_REMOTE_CODE" in err["msg"]
        assert problems(catalog(code=True), **{name: value}) == [], name
    # allowed code that is also a file still needs a root
    assert problems(catalog(code=True), tool_parser_plugin="/tmp/p.py")[0]["type"] == (
        "path_not_allowed"
    )


def test_config_files_and_sockets_are_reserved() -> None:
    assert problems(catalog(), config="/tmp/args.yaml")[0]["type"] == "reserved_arg"
    assert problems(catalog(), uds="/tmp/s.sock")[0]["type"] == "reserved_arg"


def test_integer_engine_args_are_bounded_by_what_stores_them() -> None:
    cat = catalog()
    for value in (2**31, "2T", "3G"):
        (err,) = problems(cat, max_model_len=value)
        assert err["type"] == "bad_engine_arg_value" and "2147483647" in err["msg"]
    assert problems(cat, max_model_len="2k") == [] and problems(cat, max_model_len=2**31 - 1) == []
    assert problems(cat, seed=2**64)[0]["type"] == "bad_engine_arg_value"


def test_load_catalog_binds_the_settings_policy(tmp_path: Path, monkeypatch: Any) -> None:
    python = tmp_path / "python-placeholder"
    doc = json.loads((DATA / "engine_args_vllm032cpu.json").read_text())
    doc["engine_python"] = str(python)
    monkeypatch.setenv("VLAB_PATHS__ALLOWED_ROOTS", json.dumps([str(tmp_path / "m")]))
    s = Settings(home=tmp_path, engine=EngineSettings(python=python))
    s.engine_args_cache.write_text(json.dumps(doc))
    assert s.paths.allowed_roots == [tmp_path / "m"]
    assert load_catalog(s).check({"download_dir": str(tmp_path / "m" / "x")}, []) == []
    strict = Settings(home=tmp_path, engine=EngineSettings(python=python), paths=PathSettings())
    assert load_catalog(strict).check({"download_dir": str(tmp_path / "m" / "x")}, [])


def spec_with(**extra: Any) -> ExperimentSpec:
    doc: dict[str, Any] = {
        "name": "p",
        "model": "tiny",
        "baseline": {"workload": {"num_requests": 2, "prefix_tokens": 32}},
        "repeats": 1,
    }
    doc.update(extra)
    return ExperimentSpec.model_validate(doc)


def plan_errors(spec: ExperimentSpec, cat: EngineArgCatalog) -> list[dict[str, Any]]:
    def resolver(model_dir: str, configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        raise AssertionError("vLLM must not be asked about refused arguments")

    plan = plan_experiment(
        spec, cat, model_dir="/m", model_digest="0", generated_model=True, resolver=resolver
    )
    return plan.errors


def test_variants_factors_and_ladders_go_through_the_policy() -> None:
    cat = catalog()
    spec = spec_with(
        variants=[{"name": "v", "changes": {"engine_args.chat_template": "/etc/passwd"}}],
        factors=[{"name": "dl", "paths": ["engine_args.download_dir"], "levels": ["/"]}],
    )
    got = {(".".join(map(str, e["loc"])), e["type"]) for e in plan_errors(spec, cat)}
    assert ("body.variants.0.changes.engine_args.chat_template", "path_not_allowed") in got
    assert any(loc.startswith("body.factors.") and t == "path_not_allowed" for loc, t in got)
    ladder = spec_with(preset="ladder")
    ladder.baseline.engine_args["trust_remote_code"] = True
    assert [e["type"] for e in plan_errors(ladder, cat)] == ["code_not_allowed"]


def test_model_directories_only_under_the_roots_when_roots_are_set(tmp_path: Path) -> None:
    from orchestrator.experiments.model_resolution import resolve_model

    outside = tmp_path / "elsewhere" / "m"
    inside = tmp_path / "models" / "m"
    for d in (outside, inside):
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
    open_settings = Settings(home=tmp_path / "home")
    assert resolve_model(open_settings, str(outside)).path == outside.resolve()
    roots = Settings(
        home=tmp_path / "home", paths=PathSettings(allowed_roots=[tmp_path / "models"])
    )
    assert resolve_model(roots, str(inside)).path == inside.resolve()
    with pytest.raises(SpecInvalidError) as exc:
        resolve_model(roots, str(outside))
    (err,) = exc.value.errors
    assert err["type"] == "path_not_allowed" and ROOTS_SETTING in err["msg"]
    # a name under a model root may not climb out of it
    (tmp_path / "mr").mkdir()
    climbing = Settings(
        home=tmp_path / "home",
        model_roots=[tmp_path / "mr"],
        paths=PathSettings(allowed_roots=[tmp_path / "models"]),
    )
    with pytest.raises(SpecInvalidError):
        resolve_model(climbing, "../elsewhere/m")
