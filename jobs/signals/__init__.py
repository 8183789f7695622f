"""Signals: what the engine and its GPUs report during a run, parsed and summarised.

The engine log (:mod:`~jobs.signals.enginelog`: stats lines and start-up facts, read
record by record with :mod:`~jobs.signals.logrecords` and
:mod:`~jobs.signals.statsmessage`; its error lines, :mod:`~jobs.signals.errorlines`;
its typed events on the run's timeline, :mod:`~jobs.signals.engineevents`), the
server's Prometheus ``/metrics`` (:mod:`~jobs.signals.enginemetrics`), GPU telemetry
(:mod:`~jobs.signals.gpus`) and the warm-cache check built on them
(:mod:`~jobs.signals.cachecheck`). Imports only :mod:`jobs.schemas`.
"""
