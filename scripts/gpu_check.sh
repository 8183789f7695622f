#!/usr/bin/env bash
# The GPU check (not part of CI): on a machine with an NVIDIA GPU and vLLM installed,
# run prefix caching off vs on on a real GPU and print what a reviewer needs: the
# device kind, each run's GPUs (index, UUID, rank), the TTFT ratio APC on/off and the
# energy per output token. Usage: bash scripts/gpu_check.sh
# The engine environment is VLAB_ENGINE__PYTHON (default .engine-venv/bin/python);
# `make engine` installs the CUDA build of vLLM there when nvidia-smi sees a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU here (nvidia-smi missing or failing); nothing to check" >&2
  exit 2
fi
nvidia-smi -L
make venv >/dev/null
if [[ -z "${VLAB_ENGINE__PYTHON:-}" ]]; then
  make engine >/dev/null  # vLLM's CUDA build into .engine-venv (nvidia-smi sees a GPU)
fi
ENGINE_PY="${VLAB_ENGINE__PYTHON:-$PWD/.engine-venv/bin/python}"
if ! "$ENGINE_PY" -c "import torch, vllm; assert torch.cuda.is_available(), 'torch sees no GPU'; print('vLLM', vllm.__version__, 'torch', torch.__version__, 'CUDA', torch.version.cuda)"; then
  echo "gpu_check: the engine environment ($ENGINE_PY) has no CUDA build of vLLM" >&2
  exit 2
fi
export VLAB_ENGINE__PYTHON="$ENGINE_PY"
export VLAB_HOME="${VLAB_HOME:-.vlab-gpu-check}"
exec .venv/bin/python scripts/gpu_check.py
