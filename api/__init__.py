"""vlab REST API (FastAPI). Never imports Ray."""
