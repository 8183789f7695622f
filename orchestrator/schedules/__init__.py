"""orchestrator.schedules.service."""
