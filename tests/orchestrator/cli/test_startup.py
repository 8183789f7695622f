"""The ``vlab`` command line starts fast: its module (what ``vlab --help`` and every
command calling the API load) imports none of the service's machinery; the commands
that start a service or open the database load it when they run."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO

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
    code = (
        "import sys, orchestrator.cli.main\n"
        f"heavy = {SERVICE_ONLY!r}\n"
        "print(sorted(m for m in sys.modules if any(m == h or m.startswith(h + '.') "
        "for h in heavy)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout
