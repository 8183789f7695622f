"""orchestrator.core."""
