"""orchestrator.cluster."""
