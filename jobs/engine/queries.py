"""One-shot calls to the launcher in the engine's own Python environment.

:mod:`jobs.launcher.vllm_launcher` runs by file path in the engine venv (vLLM is never imported
here); each call here starts it once with a subcommand and reads the one JSON object it
prints: ``engine-args`` (:func:`list_engine_args`), ``fingerprint``
(:func:`engine_fingerprint`), ``resolve`` (:func:`resolve_engine_configs`: the
configuration vLLM resolves for each engine-argument set) and ``resolve-model``
(:func:`resolve_model`: a model id or path resolved in this node's cache). Failures are
:class:`jobs.engine.server.EngineError` with the launcher's error lines. The long-lived server
process is :class:`jobs.engine.server.EngineServer`.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Iterable
from typing import Any

from jobs.engine.command import LAUNCHER_PATH, engine_env
from jobs.engine.server import EngineError
from jobs.schemas import EngineLaunch
from jobs.signals.enginelog import error_lines


def _run_launcher(
    engine_python: str,
    subcommand: str,
    timeout_s: float,
    *,
    stdin: bytes | None = None,
    extra_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    env = engine_env(
        EngineLaunch(
            engine_python=engine_python,
            model_dir="",
            served_model_name="",
            log_path="",
            env=extra_env or {},
        )
    )
    try:
        proc = subprocess.run(
            [engine_python, str(LAUNCHER_PATH), subcommand],
            capture_output=True,
            env=env,
            timeout=timeout_s,
            input=stdin if stdin is not None else b"",
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        err = (exc.stderr or b"").decode("utf-8", "replace")
        raise EngineError(
            f"launcher {subcommand!r} timed out after {timeout_s:.0f} s", error_lines(err, 30)
        ) from exc
    except OSError as exc:
        raise EngineError(f"cannot run {engine_python!r}: {exc}") from exc
    err = proc.stderr.decode("utf-8", "replace")
    if proc.returncode != 0:
        raise EngineError(
            f"launcher {subcommand!r} exited with code {proc.returncode}", error_lines(err, 30)
        )
    try:
        data = json.loads(proc.stdout.decode("utf-8", "replace").strip().splitlines()[-1])
    except (ValueError, IndexError) as exc:
        raise EngineError(f"launcher {subcommand!r} printed no JSON", error_lines(err, 30)) from exc
    if not isinstance(data, dict):
        raise EngineError(f"launcher {subcommand!r} printed {type(data).__name__}, not an object")
    return data


def resolve_model(
    engine_python: str,
    model: str,
    revision: str | None = None,
    *,
    model_roots: Iterable[str] = (),
    digests: bool = True,
    digest_cache: str | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """Resolve ``model`` on this node the way vLLM would (``vllm_launcher.py resolve-model``).

    A directory, a name under one of ``model_roots``, or a Hugging Face id at
    ``revision`` in this node's HF cache (``HF_HOME``; offline with
    ``HF_HUB_OFFLINE=1``), run in the engine's own interpreter and environment
    (``env`` on top, as for a launch). Returns the launcher's document: ``source``,
    ``path`` (on this node), ``revision`` (snapshot commit), ``weights_cached``,
    ``files`` (``[{"path", "size", "sha256"}]``), ``config`` and ``meta_files``
    (base64 tokenizer and config files). Raises :class:`EngineError` with the
    node's one-sentence answer when the model cannot be resolved here.
    """
    args = ["--model", model]
    if revision:
        args += ["--revision", revision]
    for root in model_roots:
        args += ["--model-root", str(root)]
    if not digests:
        args.append("--no-digests")
    if digest_cache:
        args += ["--digest-cache", digest_cache]
    launch = EngineLaunch(
        engine_python=engine_python,
        model_dir="",
        served_model_name="",
        log_path="",
        env=dict(env or {}),
    )
    argv = [engine_python, str(LAUNCHER_PATH), "resolve-model", *args]
    try:
        proc = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            env=engine_env(launch),
            stdin=subprocess.DEVNULL,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise EngineError(f"resolving model {model!r} took longer than {timeout_s:g} s") from exc
    except OSError as exc:
        raise EngineError(f"cannot run the engine python {engine_python!r}: {exc}") from exc
    doc: Any = None
    lines = proc.stdout.strip().splitlines()
    with contextlib.suppress(ValueError, IndexError):
        doc = json.loads(lines[-1])
    if isinstance(doc, dict) and doc.get("error"):
        raise EngineError(str(doc["error"]))
    if proc.returncode != 0 or not isinstance(doc, dict):
        tail = [ln for ln in proc.stderr.strip().splitlines()[-8:] if ln.strip()]
        raise EngineError(f"resolving model {model!r} failed (exit code {proc.returncode})", tail)
    return doc


def list_engine_args(engine_python: str, timeout_s: float = 180.0) -> dict[str, Any]:
    """Every ``vllm serve`` argument of the engine environment, from vLLM's own parser.

    Returns ``{"vllm_version": str, "args": [{"dest", "options", "default",
    "type", "choices", "nargs", "is_bool_flag", "action", "group", "help"}, ...]}``
    (about 320 entries for vLLM 0.32; takes ~10 s). Raises :class:`EngineError`
    with the stderr tail on failure or timeout.
    """
    return _run_launcher(engine_python, "engine-args", timeout_s)


def engine_fingerprint(engine_python: str, timeout_s: float = 60.0) -> dict[str, Any]:
    """Versions (python, vllm, torch, transformers) and platform of an engine environment.

    Raises :class:`EngineError` on failure.
    """
    return _run_launcher(engine_python, "fingerprint", timeout_s)


def resolve_engine_configs(
    engine_python: str,
    model_dir: str,
    configs: list[dict[str, Any]],
    timeout_s: float = 300,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The engine configuration vLLM really uses for each set of engine args, without serving.

    Runs the launcher's ``resolve`` subcommand once for the whole list (vLLM's
    import, ~10 s, is paid once; each config then takes well under a second).
    Each config (engine args in snake_case, as in ``EngineLaunch.engine_args``)
    goes through vLLM's own ``serve`` parser, ``AsyncEngineArgs.from_cli_args``
    and ``create_engine_config(usage_context=OPENAI_API_SERVER)`` on the
    engine's platform, so every default vLLM derives from other settings is
    applied (``max_num_batched_tokens`` / ``max_num_seqs`` from the world size,
    ``max_model_len`` and chunked prefill; ``enable_prefix_caching`` and
    ``enable_chunked_prefill`` from the model; CPU ``block_size`` 128;
    ``kv_cache_memory_bytes`` from ``VLLM_CPU_KVCACHE_SPACE``). No engine is
    started and no KV cache allocated.

    ``env``: extra environment, as ``EngineLaunch.env`` (the launcher runs in
    :func:`engine_env`, so ``VLLM_CPU_KVCACHE_SPACE`` defaults to 1 GiB as for
    a served run).

    Returns ``{"vllm_version": str, "results": [...]}`` with one item per
    config, in order: ``{"ok": True, "argv": [...], "config": {"<section>.<field>":
    value, ...}}`` (sections ``model_config``, ``cache_config``,
    ``scheduler_config``, ``parallel_config``, ``load_config``,
    ``device_config``, ``attention_config``; plus ``compilation_config.mode``
    / ``.backend`` / ``.cudagraph_mode``, ``speculative_config.enabled``,
    ``lora_config.enabled``; enums by name, dtypes as ``"bfloat16"``) or
    ``{"ok": False, "argv": [...] | None, "error": "<Type>: <vLLM's message>"}``
    for a config vLLM rejects. Raises :class:`EngineError` if the launcher
    itself fails or times out.
    """
    request = json.dumps({"model": model_dir, "configs": configs}).encode()
    data = _run_launcher(engine_python, "resolve", timeout_s, stdin=request, extra_env=env)
    results = data.get("results")
    if not isinstance(results, list) or len(results) != len(configs):
        raise EngineError(
            f"launcher 'resolve' returned {len(results) if isinstance(results, list) else 'no'} "
            f"results for {len(configs)} configs"
        )
    return data
