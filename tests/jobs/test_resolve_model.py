"""``vllm_launcher.py resolve-model`` and ``fingerprint --model NAME``: models named the vLLM way.

The launcher runs as a subprocess with this (service) venv's python, which has
``huggingface_hub`` but no vLLM. Hugging Face caches are laid out by hand in
temporary folders exactly like the real one (``models--org--name/{blobs,refs,
snapshots/<sha>}``, snapshot files being relative symlinks into ``blobs/``);
the one online download talks to a fake Hub on 127.0.0.1. A ``huggingface_hub`` package that
fails to import, put first on ``PYTHONPATH``, exercises the by-hand fallback.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import unquote, urlparse

import pytest

from jobs.engine.command import LAUNCHER_PATH
from jobs.modelgen.generator import generate_model

PY = sys.executable
LAUNCHER = LAUNCHER_PATH
REPO_ID = "acme/tiny-chat"
OLD_SHA = "1f" * 20
NEW_SHA = "9c0ffee" + "5" * 33
TIMEOUT_S = 60


@dataclass
class Result:
    rc: int
    doc: dict[str, Any]
    stderr: str


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any Hugging Face setting, plus ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "PYTHONPATH"))
    }
    env.update(extra)
    return env


def launch(
    *args: str, env: Mapping[str, str], cwd: Path | None = None, command: str = "resolve-model"
) -> Result:
    proc = subprocess.run(
        [PY, str(LAUNCHER), command, *args],
        capture_output=True,
        text=True,
        env=dict(env),
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        timeout=TIMEOUT_S,
        check=False,
    )
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    return Result(proc.returncode, json.loads(lines[0]), proc.stderr)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def add_snapshot(hub: Path, repo_id: str, sha: str, src: Path, **extra: bytes) -> Path:
    """Add ``src``'s files (plus ``extra``: relative path -> bytes) as snapshot ``sha``.

    Blobs are named by their content's sha256 (as LFS files are); snapshot entries
    are relative symlinks into ``blobs/``, like ``huggingface_hub`` makes them.
    """
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / sha
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    contents = {
        p.relative_to(src).as_posix(): p.read_bytes() for p in src.rglob("*") if p.is_file()
    }
    contents.update(extra)
    for rel, data in contents.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snapshot


def set_ref(hub: Path, repo_id: str, ref: str, sha: str) -> None:
    path = hub / ("models--" + repo_id.replace("/", "--")) / "refs" / ref
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(sha)  # no newline, as huggingface_hub writes it


def _no_hub_shim(directory: Path) -> Path:
    """A ``PYTHONPATH`` entry (``directory``) on which ``import huggingface_hub`` fails."""
    shim = directory / "huggingface_hub"
    shim.mkdir(exist_ok=True)
    (shim / "__init__.py").write_text('raise ImportError("huggingface_hub blocked by the test")\n')
    return directory


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A generated model directory (config.json, generation config, tokenizer files)."""
    return generate_model(tmp_path_factory.mktemp("gen") / "tiny", "tiny", seed=0)


@dataclass
class Cache:
    home: Path  # HF_HOME
    hub: Path  # HF_HOME/hub
    old: Path  # snapshot OLD_SHA (tag v1.0)
    new: Path  # snapshot NEW_SHA (main)
    env: dict[str, str]  # offline, HF_HOME set
    no_hub_env: dict[str, str]  # the same, with huggingface_hub unimportable


@pytest.fixture(scope="module")
def cache(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Cache:
    """``acme/tiny-chat`` with two snapshots: v1.0 (old) and main (new, with weights)."""
    home = tmp_path_factory.mktemp("hf")
    hub = home / "hub"
    old_config = json.loads((tiny / "config.json").read_text())
    old_config["test_snapshot"] = "old"
    old = add_snapshot(
        hub, REPO_ID, OLD_SHA, tiny, **{"config.json": json.dumps(old_config).encode()}
    )
    new = add_snapshot(
        hub,
        REPO_ID,
        NEW_SHA,
        tiny,
        **{"model.safetensors": b"\0" * 1024, "additional_chat_templates/tool.jinja": b"{{ x }}"},
    )
    set_ref(hub, REPO_ID, "main", NEW_SHA)
    set_ref(hub, REPO_ID, "v1.0", OLD_SHA)
    env = _clean_env(HF_HOME=str(home), HF_HUB_OFFLINE="1")
    no_hub_env = {**env, "PYTHONPATH": str(_no_hub_shim(tmp_path_factory.mktemp("shim")))}
    return Cache(home, hub, old, new, env, no_hub_env)


def expected_files(directory: Path, digests: bool = True) -> list[dict[str, Any]]:
    return sorted(
        (
            {
                "path": p.relative_to(directory).as_posix(),
                "size": p.stat().st_size,
                "sha256": sha256(p) if digests else None,
            }
            for p in directory.rglob("*")
            if p.is_file()
        ),
        key=lambda f: f["path"],
    )


# --------------------------------------------------------------------------- directories


def test_local_dir(tiny: Path, tmp_path: Path) -> None:
    env = _clean_env(HF_HOME=str(tmp_path / "empty-hf"), HF_HUB_OFFLINE="1")
    res = launch("--model", str(tiny), env=env)

    assert res.rc == 0, res
    doc = res.doc
    assert doc["source"] == "local_dir"
    assert doc["model"] == str(tiny) and doc["requested_revision"] is None
    assert doc["path"] == str(tiny)
    assert doc["revision"] is None and doc["hf_cache"] is None
    assert doc["offline"] is True
    assert doc["weights_cached"] is False
    assert doc["files"] == expected_files(tiny)
    assert doc["config"] == json.loads((tiny / "config.json").read_text())
    assert doc["meta_skipped"] == []
    assert sorted(doc["meta_files"]) == sorted(p.name for p in tiny.iterdir())

    # relative to the working directory, and with ~
    rel = launch("--model", "tiny", env=env, cwd=tiny.parent)
    assert rel.rc == 0 and rel.doc["source"] == "local_dir" and rel.doc["path"] == str(tiny)
    home = launch("--model", "~/tiny", env={**env, "HOME": str(tiny.parent)}, cwd=tmp_path)
    assert home.rc == 0 and home.doc["path"] == str(tiny)


def test_model_root(tiny: Path, tmp_path: Path) -> None:
    roots = [tmp_path / "empty-root", tmp_path / "root"]
    roots[0].mkdir()
    shutil.copytree(tiny, roots[1] / "team" / "tiny-chat")
    env = _clean_env(HF_HOME=str(tmp_path / "empty-hf"), HF_HUB_OFFLINE="1")
    args = ["--model-root", str(roots[0]), "--model-root", str(roots[1]), "--no-digests"]

    res = launch("--model", "team/tiny-chat", *args, env=env, cwd=tmp_path)
    assert res.rc == 0, res
    assert res.doc["source"] == "model_root"
    assert res.doc["path"] == str(roots[1] / "team" / "tiny-chat")
    assert res.doc["revision"] is None
    assert all(f["sha256"] is None for f in res.doc["files"])

    # no escaping a model root ("<empty-root>/../root/team/tiny-chat" exists)
    bad = launch("--model", "../root/team/tiny-chat", *args, env=env, cwd=tmp_path)
    assert bad.rc == 3
    assert "not a valid Hugging Face repo id" in bad.doc["error"]


# --------------------------------------------------------------------------- the HF cache


def test_hf_id_at_main(cache: Cache) -> None:
    res = launch("--model", REPO_ID, env=cache.env)

    assert res.rc == 0, res
    doc = res.doc
    assert doc["source"] == "hf_cache"
    assert doc["revision"] == NEW_SHA
    assert doc["requested_revision"] is None
    assert doc["path"] == str(cache.new)
    assert doc["hf_cache"] == str(cache.hub)
    assert doc["offline"] is True
    assert doc["weights_cached"] is True
    # digests are the content's, through the symlinks into blobs/
    assert doc["files"] == expected_files(cache.new)
    for entry in doc["files"]:
        target = (cache.new / entry["path"]).resolve()
        assert target.parent.name == "blobs"
        assert entry["sha256"] == hashlib.sha256(target.read_bytes()).hexdigest()
    paths = [f["path"] for f in doc["files"]]
    assert "model.safetensors" in paths and "additional_chat_templates/tool.jinja" in paths
    # metadata, not weights, travels back; tokenizer.json byte for byte
    meta = {k: base64.b64decode(v) for k, v in doc["meta_files"].items()}
    assert meta["tokenizer.json"] == (cache.new / "tokenizer.json").read_bytes()
    assert meta["additional_chat_templates/tool.jinja"] == b"{{ x }}"
    assert "model.safetensors" not in meta
    assert doc["config"] == json.loads((cache.new / "config.json").read_text())

    explicit = launch("--model", REPO_ID, "--revision", "main", env=cache.env)
    assert explicit.rc == 0 and explicit.doc["revision"] == NEW_SHA
    assert explicit.doc["requested_revision"] == "main"


@pytest.mark.parametrize(
    ("revision", "sha"),
    [
        (NEW_SHA, NEW_SHA),  # full sha
        (NEW_SHA[:7], NEW_SHA),  # short sha
        (OLD_SHA[:10], OLD_SHA),
        ("v1.0", OLD_SHA),  # a tag in refs/
    ],
    ids=["full-sha", "short-sha", "short-sha-old", "tag"],
)
def test_hf_id_at_revision(cache: Cache, revision: str, sha: str) -> None:
    res = launch("--model", REPO_ID, "--revision", revision, "--no-digests", env=cache.env)

    assert res.rc == 0, res
    assert res.doc["revision"] == sha
    assert res.doc["requested_revision"] == revision
    assert res.doc["path"] == str(cache.hub / "models--acme--tiny-chat" / "snapshots" / sha)
    assert res.doc["config"].get("test_snapshot") == ("old" if sha == OLD_SHA else None)
    assert res.doc["weights_cached"] is (sha == NEW_SHA)


def test_ambiguous_or_unknown_revision(cache: Cache, tmp_path: Path) -> None:
    hub = tmp_path / "hub"
    add_snapshot(hub, REPO_ID, "abc0" * 10, cache.old)
    add_snapshot(hub, REPO_ID, "abc1" * 10, cache.old)
    env = _clean_env(HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1")

    res = launch("--model", REPO_ID, "--revision", "abc1", "--no-digests", env=env)
    assert res.rc == 0 and res.doc["revision"] == "abc1" * 10
    assert res.doc["hf_cache"] == str(hub)  # HF_HUB_CACHE wins over HF_HOME
    amb = launch("--model", REPO_ID, "--revision", "ab", "--no-digests", env=env)  # too short
    assert amb.rc == 3
    amb = launch("--model", REPO_ID, "--revision", "abc", "--no-digests", env=env)
    assert amb.rc == 3 and "ambiguous" in amb.doc["error"]
    missing = launch("--model", REPO_ID, "--revision", "v9", env=env)
    assert missing.rc == 3 and "(revision v9)" in missing.doc["error"]
    bad = launch("--model", REPO_ID, "--revision", "../../etc", env=env)
    assert bad.rc == 3 and "not a valid revision" in bad.doc["error"]


def test_unknown_id_offline_names_cache_and_offline(cache: Cache) -> None:
    res = launch("--model", "acme/unknown", env=cache.env)

    assert res.rc == 3
    error = res.doc["error"]
    assert str(cache.hub) in error and "HF_HUB_OFFLINE=1" in error
    assert "acme/unknown" in error and "revision main" in error
    assert res.doc["model"] == "acme/unknown"
    assert res.doc["hf_cache"] == str(cache.hub) and res.doc["offline"] is True


@pytest.mark.parametrize("name", ["../etc", "/etc", "acme/../../etc", "a--b/c", "acme/x/y"])
def test_bad_ids_refused(cache: Cache, name: str) -> None:
    res = launch("--model", name, env=cache.env)
    assert res.rc == 3
    assert "not a valid Hugging Face repo id" in res.doc["error"]
    assert res.doc["hf_cache"] is None


def test_by_hand_fallback_gives_the_same_answer(cache: Cache, tmp_path: Path) -> None:
    for args in (
        [],
        ["--revision", "v1.0"],
        ["--revision", NEW_SHA],
        ["--revision", OLD_SHA[:8]],
    ):
        with_hub = launch("--model", REPO_ID, *args, env=cache.env)
        by_hand = launch("--model", REPO_ID, *args, env=cache.no_hub_env)
        assert with_hub.rc == by_hand.rc == 0, (args, by_hand)
        assert "blocked by the test" in by_hand.stderr  # the fallback really ran
        assert "blocked by the test" not in with_hub.stderr
        assert by_hand.doc == with_hub.doc, args

    # the cache location without huggingface_hub: HF_HOME, HF_HUB_CACHE, ~/.cache
    unknown = launch("--model", "acme/unknown", env=cache.no_hub_env)
    assert unknown.rc == 3 and str(cache.hub) in unknown.doc["error"]
    env = {k: v for k, v in cache.no_hub_env.items() if k not in ("HF_HOME", "XDG_CACHE_HOME")}
    default = launch("--model", "acme/unknown", env={**env, "HOME": str(tmp_path)})
    assert default.doc["hf_cache"] == str(tmp_path / ".cache" / "huggingface" / "hub")
    online = launch("--model", "acme/unknown", env={**env, "HF_HUB_OFFLINE": "0"})
    assert online.rc == 3 and "huggingface_hub is not installed" in online.doc["error"]


def test_hub_errors_are_reported(cache: Cache) -> None:
    """Online, not cached: the hub is asked for the metadata; its failure is the error."""
    env = {**cache.env, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}
    res = launch("--model", "acme/unknown", env=env)
    assert res.rc == 3
    assert res.doc["offline"] is False
    assert "fetching it from the Hugging Face Hub failed" in res.doc["error"]
    # cached: no hub needed even online
    assert launch("--model", REPO_ID, "--no-digests", env=env).doc["revision"] == NEW_SHA


class _FakeHub(BaseHTTPRequestHandler):
    """Just enough of the Hub's HTTP API for ``snapshot_download`` of ``acme/web-chat``."""

    repo = "acme/web-chat"
    sha = "5e" * 20
    files: ClassVar[dict[str, bytes]] = {
        "config.json": b'{"model_type": "llama"}',
        "tokenizer.json": b'{"version": "1.0"}',
        "chat_template.jinja": b"{{ messages }}",
        "README.md": b"# web chat",
        "model-00001-of-00001.safetensors": b"W" * 4096,
    }
    served: ClassVar[list[str]] = []

    def log_message(self, *args: Any) -> None:
        pass

    def _reply(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for key, value in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_GET(self) -> None:
        path = unquote(urlparse(self.path).path)
        api = f"/api/models/{self.repo}"
        if path in (f"{api}/revision/main", f"{api}/revision/{self.sha}"):
            info = {"id": self.repo, "sha": self.sha}
            return self._reply(200, json.dumps(info).encode(), {"Content-Type": "application/json"})
        if path == f"{api}/tree/{self.sha}":
            tree = [
                {"type": "file", "oid": hashlib.sha1(d).hexdigest(), "size": len(d), "path": f}
                for f, d in self.files.items()
            ]
            return self._reply(200, json.dumps(tree).encode(), {"Content-Type": "application/json"})
        name = path.removeprefix(f"/{self.repo}/resolve/{self.sha}/")
        if name in self.files:
            if self.command == "GET":
                self.served.append(name)
            data = self.files[name]
            etag = f'"{hashlib.sha1(data).hexdigest()}"'
            return self._reply(200, data, {"X-Repo-Commit": self.sha, "ETag": etag})
        return self._reply(
            404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"}
        )

    do_HEAD = do_GET


@pytest.fixture
def fake_hub() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_online_fetches_only_metadata_from_the_hub(fake_hub: str, tmp_path: Path) -> None:
    online = _clean_env(
        HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT=fake_hub, HF_HUB_DISABLE_TELEMETRY="1"
    )
    res = launch("--model", "acme/web-chat", env=online)

    assert res.rc == 0, res
    doc = res.doc
    sha = _FakeHub.sha
    assert doc["source"] == "hf_hub" and doc["offline"] is False
    assert doc["revision"] == sha and doc["weights_cached"] is False
    assert doc["path"] == str(
        tmp_path / "hf" / "hub" / "models--acme--web-chat" / "snapshots" / sha
    )
    assert sorted(_FakeHub.served) == ["chat_template.jinja", "config.json", "tokenizer.json"]
    assert [f["path"] for f in doc["files"]] == sorted(_FakeHub.served)
    assert {k: base64.b64decode(v) for k, v in doc["meta_files"].items()} == {
        k: _FakeHub.files[k] for k in _FakeHub.served
    }
    assert doc["config"] == {"model_type": "llama"}

    # afterwards, offline: the metadata-only snapshot is in the cache, without weights
    offline = {**online, "HF_HUB_OFFLINE": "1"}
    for env in (offline, {**offline, "PYTHONPATH": str(_no_hub_shim(tmp_path))}):
        again = launch("--model", "acme/web-chat", env=env)
        assert again.rc == 0, again
        assert again.doc["source"] == "hf_cache" and again.doc["revision"] == sha
        assert again.doc["weights_cached"] is False
        assert again.doc["files"] == doc["files"]

    missing = launch("--model", "acme/absent", env=online)
    assert missing.rc == 3
    assert (
        "fetching it from the Hugging Face Hub failed: RepositoryNotFoundError"
        in (missing.doc["error"])
    )


def test_digest_cache_and_meta_limits(cache: Cache, tiny: Path, tmp_path: Path) -> None:
    digest_cache = tmp_path / "digests.json"
    first = launch("--model", REPO_ID, "--digest-cache", str(digest_cache), env=cache.env)
    entries = json.loads(digest_cache.read_text())
    assert sorted(entries) == sorted(str(cache.new / f["path"]) for f in first.doc["files"])
    assert {e["sha256"] for e in entries.values()} == {f["sha256"] for f in first.doc["files"]}
    second = launch("--model", REPO_ID, "--digest-cache", str(digest_cache), env=cache.env)
    assert second.doc == first.doc

    model = tmp_path / "big"
    shutil.copytree(tiny, model)
    with open(model / "vocab.txt", "wb") as fh:  # sparse: 21 MiB, over the per-file limit
        fh.truncate(21 * 2**20)
    res = launch("--model", str(model), "--no-digests", env=cache.env)
    assert res.rc == 0
    assert "vocab.txt" not in res.doc["meta_files"] and "tokenizer.json" in res.doc["meta_files"]
    assert res.doc["meta_skipped"] == [
        {"path": "vocab.txt", "size": 21 * 2**20, "reason": "larger than 20 MiB"}
    ]


# --------------------------------------------------------------------------- fingerprint


def test_fingerprint_by_model_id_carries_the_revision(cache: Cache, tiny: Path) -> None:
    fp = launch("--model", REPO_ID, "--revision", "v1.0", command="fingerprint", env=cache.env)
    assert fp.rc == 0
    assert fp.doc["model_source"] == "hf_cache"
    assert fp.doc["model_revision"] == OLD_SHA
    assert fp.doc["model_path"] == str(cache.old) and fp.doc["model_path_exists"] is True
    assert fp.doc["model_files"] == expected_files(cache.old)

    main = launch("--model", REPO_ID, command="fingerprint", env=cache.env)
    assert main.doc["model_revision"] == NEW_SHA

    # --model-dir: the keys of old; --model with a directory: plus source and revision
    by_dir = launch("--model-dir", str(tiny), command="fingerprint", env=cache.env)
    assert by_dir.doc["model_files"] == expected_files(tiny)
    assert "model_revision" not in by_dir.doc and "model_source" not in by_dir.doc
    by_name = launch("--model", str(tiny), command="fingerprint", env=cache.env)
    assert by_name.doc["model_files"] == by_dir.doc["model_files"]
    assert by_name.doc["model_source"] == "local_dir" and by_name.doc["model_revision"] is None

    # not resolvable: reported in the fingerprint (parity blocks), not an error exit
    gone = launch("--model", "acme/unknown", command="fingerprint", env=cache.env)
    assert gone.rc == 0
    assert gone.doc["model_path_exists"] is False and gone.doc["model_files"] == []
    assert gone.doc["model_revision"] is None and "HF_HUB_OFFLINE" in gone.doc["model_error"]
