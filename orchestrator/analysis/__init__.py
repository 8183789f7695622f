"""orchestrator.analysis.service."""
