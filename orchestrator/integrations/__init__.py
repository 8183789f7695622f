"""Integrations: the service's results sent to systems outside it (MLflow tracking).

Each module reads through the repositories and talks to its outside system itself;
its client library is optional and imported only when an export runs.
"""
