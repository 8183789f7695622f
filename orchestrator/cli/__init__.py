"""orchestrator.cli.main."""
