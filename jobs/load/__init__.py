"""Load: the request lists of a run and the load generator that sends them.

:mod:`~jobs.load.workload` builds the deterministic request list of a run (texts from
:mod:`~jobs.load.texts`, or the user's own requests: :mod:`~jobs.load.replay`);
:mod:`~jobs.load.loadgen` sends it (closed or open loop) over
:mod:`~jobs.load.sseclient` and times every request, in one process or several
(:mod:`~jobs.load.loadpool`, :mod:`~jobs.load.loadworker`);
:mod:`~jobs.load.loadceiling` measures the highest rate it sustains where it runs
(against :mod:`jobs.stub`). Imports :mod:`jobs.schemas`, :mod:`jobs.modelgen` (the
corpus) and :mod:`jobs.stub`.
"""
