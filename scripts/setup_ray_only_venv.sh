#!/usr/bin/env bash
# A venv with Ray only (the `ray[default]` a Ray cluster's nodes run, nothing of vlab's):
# the nodes of the external-cluster tests (tests/test_external_ray_cluster.py) start
# from it, so the service must ship its code to them. Same Python interpreter and the
# same Ray version as the service's venv (Ray refuses a driver of another version).
# Usage: scripts/setup_ray_only_venv.sh [VENV_DIR] [SERVICE_PYTHON]
#        (defaults .ray-only-venv and .venv/bin/python)
set -euo pipefail
VENV="${1:-.ray-only-venv}"
SERVICE_PY="${2:-.venv/bin/python}"
RAY_VERSION="$("$SERVICE_PY" -c 'import ray; print(ray.__version__)')"
BASE_PY="$("$SERVICE_PY" -c 'import sys; print(sys._base_executable)')"
if [[ -f "$VENV/.ok" ]] && [[ "$(cat "$VENV/.ok")" == "ray $RAY_VERSION" ]]; then
  exit 0
fi
echo "ray-only environment: $VENV with ray[default]==$RAY_VERSION ($BASE_PY)"
# The .ok marker (naming the Ray version) is written last: an interrupted set-up is redone.
rm -rf "$VENV"
"$BASE_PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check "ray[default]==$RAY_VERSION" 2>&1 \
  | grep -v "is ignored: it is neither" || true
"$VENV/bin/python" -c "import ray; assert ray.__version__ == '$RAY_VERSION'"
if "$VENV/bin/python" -I -c "import jobs" 2>/dev/null; then
  echo "error: $VENV can import vlab's jobs package" >&2
  exit 1
fi
echo "ray $RAY_VERSION" > "$VENV/.ok"
