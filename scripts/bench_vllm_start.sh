#!/usr/bin/env bash
# One vLLM start on the generated tiny model, to healthy and stopped, the way runs start it
# (the launcher's `serve`, --load-format dummy, 1 GiB of KV cache), in a cpuacct cgroup of
# its own: prints its wall time to healthy and the CPU-seconds of all its processes.
# Usage (as root): scripts/bench_vllm_start.sh LABEL [extra vLLM arguments, e.g. --enforce-eager]
# docs/BENCHMARKS.md ("enforce_eager in the tests") has figures.
set -euo pipefail
label="$1"
shift
cd "$(dirname "$0")/.."
cg="/sys/fs/cgroup/cpuacct/vlab_bench_$label"
mkdir -p "$cg"
echo $$ >"$cg/cgroup.procs"
model="${TMPDIR:-/tmp}/vlab-bench-model/tiny"
[[ -d "$model" ]] || .venv/bin/python -c \
  "from jobs.modelgen.generator import generate_model; generate_model('$model', 'tiny', seed=0)"
port=$((20000 + RANDOM % 10000))
log="${TMPDIR:-/tmp}/vlab_bench_$label.log"
c0=$(cat "$cg/cpuacct.usage")
t0=$(date +%s.%N)
VLLM_CPU_KVCACHE_SPACE=1 setsid .engine-venv/bin/python jobs/launcher/vllm_launcher.py serve \
  "$model" --load-format dummy --max-model-len 2048 --port "$port" "$@" >"$log" 2>&1 &
pid=$!
until curl -sf "localhost:$port/health" >/dev/null; do
  sleep 0.5
  kill -0 "$pid" 2>/dev/null || { echo "the server exited: $log"; exit 1; }
done
t1=$(date +%s.%N)
c1=$(cat "$cg/cpuacct.usage")
kill -TERM -- "-$pid"
wait "$pid" 2>/dev/null || true
c2=$(cat "$cg/cpuacct.usage")
python3 -c "print('$label: healthy in %.1f s, %.1f CPU-s to healthy, %.1f with the stop' \
  % ($t1 - $t0, ($c1 - $c0) / 1e9, ($c2 - $c0) / 1e9))"
