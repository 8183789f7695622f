"""Tuning campaigns: the pure core of the loop that finds a workload's best configuration
one variable at a time (issue 25).

No database, no Ray, no HTTP: decisions over recorded measurements. ``decision`` holds the
rule (paired intervals on log ratios; a candidate pays, is inert by an equivalence test, is
worse, marginal or undecided), ``space`` the variables and an incumbent's one-variable
neighbours, ``loop`` the campaign as a state machine that a restarted service rebuilds from
the runs it recorded, ``outcomes`` what it plans and decides (runs, candidates, steps, the
confirmation).
"""
