"""orchestrator.runs."""
