"""orchestrator.experiments."""
