"""The stub: an OpenAI-compatible stand-in for a vLLM server, with known timing.

:mod:`~jobs.stub.stubserver` answers completions at a set time to the first token
and between tokens (``python -m jobs.stub.stubserver``), its engine side simulated
by :mod:`~jobs.stub.stubengine` (service slots, prefix caching) on the socket of
:mod:`~jobs.stub.stubsocket`. For loopback benchmarks, the load generator's ceiling
(:mod:`jobs.load.loadceiling`) and tests. Imports nothing else of ``jobs``.
"""
