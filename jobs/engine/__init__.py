"""The engine on this node: the vLLM server process and one-shot calls into its python.

:mod:`~jobs.engine.server` starts, watches and stops ``vllm serve`` (through the
launcher, :mod:`jobs.launcher`, run by path with the engine environment's python);
:mod:`~jobs.engine.processes` reads its processes from ``/proc``;
:mod:`~jobs.engine.queries` runs the launcher's one-shot commands (``engine-args``,
``resolve-model``, ``resolve``); :mod:`~jobs.engine.nodeprobe` and
:mod:`~jobs.engine.envfacts` describe this node's engine environment for the parity
check. Imports :mod:`jobs.signals` (the engine's log) and :mod:`jobs.schemas`.
"""
