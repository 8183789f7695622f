"""vlab orchestrator: domain, persistence, experiment rules, dispatcher and Ray layer.

Nothing imported from this package's top level pulls in Ray; Ray-specific code
lives in :mod:`orchestrator.dispatch.ray`.
"""
