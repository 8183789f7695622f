"""orchestrator.dispatch."""
