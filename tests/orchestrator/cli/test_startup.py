"""The ``vlab`` command line starts fast: its module (what ``vlab --help`` and every
command calling the API load) imports none of the service's machinery; the commands
that start a service or open the database load it when they run."""

from __future__ import annotations

from tests.imports import loaded_after

#: What only the service needs (the API's app and its routes, the database, the
#: dispatcher, the analyses and the engine's catalogue): about 2 s of imports before.
SERVICE_ONLY = (
    "api",
    "fastapi",
    "mlflow",
    "numpy",
    "orchestrator.cli.runtime",
    "orchestrator.dispatch",
    "pandas",
    "ray",
    "scipy",
    "sqlalchemy",
    "uvicorn",
)


def test_the_cli_module_imports_none_of_the_services_machinery() -> None:
    assert loaded_after(["orchestrator.cli.main"], SERVICE_ONLY) == []
