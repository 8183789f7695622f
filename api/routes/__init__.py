"""api.routes."""
