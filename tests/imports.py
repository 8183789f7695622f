"""What a fresh Python process has loaded after importing some of the project's modules
(the layer rules' and the CLI's start-up checks)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def loaded_after(imports: Sequence[str], packages: Sequence[str]) -> list[str]:
    """The modules of ``packages`` (each a package or module name: itself and what lies
    under it) loaded, sorted, once a new interpreter in the repository has imported
    ``imports``; fails the test when the imports do."""
    code = (
        f"import json, sys, {', '.join(imports)}\n"
        f"names = {tuple(packages)!r}\n"
        "print(json.dumps(sorted(m for m in sys.modules if any(m == n or m.startswith(n + '.') "
        "for n in names))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    loaded: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return loaded
