"""One run on this node, start to result: the top of ``jobs``.

:mod:`~jobs.run.runner` executes a :class:`~jobs.schemas.RunJob` (or a batch of runs
sharing one server): starts the engine, warms it up, drives the load or the capacity
search, scrapes and watches (:mod:`~jobs.run.enginewatch`: is the engine hung?),
journals what it measured (:mod:`~jobs.run.journal`) and returns the result
(:mod:`~jobs.run.segment`, :mod:`~jobs.run.runresult`). May import every room of
``jobs``.
"""
