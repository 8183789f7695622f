"""Capacity under SLOs: the highest load one server sustains while every objective holds.

:mod:`~jobs.capacity.search` holds the search (its spec and result are part of the
node contract, :mod:`jobs.schemas`); :mod:`~jobs.capacity.steadystate` plans a load
step and reads its records, :mod:`~jobs.capacity.slochecks` checks each objective,
:mod:`~jobs.capacity.verdict` decides a step; :mod:`~jobs.capacity.loadsteps` runs
the steps on a running server. Imports :mod:`jobs.schemas`, :mod:`jobs.load` and
:mod:`jobs.signals`.
"""
