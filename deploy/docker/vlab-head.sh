#!/usr/bin/env bash
# The Ray head container of the vlab RayCluster: Ray's head node, then the vlab service
# (`vlab up`: API on :8000 and the orchestrator) as a driver of that head.
#
# The RayCluster carries `ray.io/overwrite-container-cmd: "true"`, so KubeRay does not
# wrap this container's command; it hands over the `ray start --head ... --block` it
# generated in $KUBERAY_GEN_RAY_START_CMD (and RAY_AUTH_TOKEN when authOptions.mode is
# token). Whichever of the two processes ends first ends the container, and the kubelet
# restarts it. On SIGTERM the service stops first (its active runs are cancelled and
# recorded), then Ray.
set -uo pipefail

: "${KUBERAY_GEN_RAY_START_CMD:?not started by KubeRay: set KUBERAY_GEN_RAY_START_CMD to a ray start --head command}"
ulimit -n "${RAY_START_ULIMIT_OPEN_FILES:-65536}" || true

bash -c "${KUBERAY_GEN_RAY_START_CMD}" &
ray_pid=$!

# the service joins the local head (RAY_ADDRESS, 127.0.0.1:6379 in the manifests) once
# its GCS answers
address="${RAY_ADDRESS:-127.0.0.1:6379}"
for _ in $(seq 1 150); do
  if ray status --address "${address}" >/dev/null 2>&1; then
    break
  fi
  if ! kill -0 "${ray_pid}" 2>/dev/null; then
    wait "${ray_pid}"
    echo "vlab-head: ray start exited ($?) before its GCS answered" >&2
    exit 1
  fi
  sleep 2
done

# the container's log (kubectl logs) gets everything the service and its libraries write,
# not only vlab's own lines (the image sets it too; set it to false to keep the rest in
# $VLAB_HOME/logs/vlab.log)
export VLAB_LOG_TO_CONSOLE="${VLAB_LOG_TO_CONSOLE:-true}"
vlab up --host "${VLAB_API__HOST:-0.0.0.0}" --port "${VLAB_API__PORT:-8000}" &
vlab_pid=$!

stop() {
  kill -TERM "${vlab_pid}" 2>/dev/null && wait "${vlab_pid}"
  ray stop --force >/dev/null 2>&1 || kill -TERM "${ray_pid}" 2>/dev/null
  wait "${ray_pid}" 2>/dev/null
  exit 143
}
trap stop TERM INT

wait -n "${ray_pid}" "${vlab_pid}"
status=$?
echo "vlab-head: $( kill -0 "${vlab_pid}" 2>/dev/null && echo ray || echo 'vlab up') exited (${status})" >&2
kill -TERM "${vlab_pid}" 2>/dev/null && wait "${vlab_pid}" 2>/dev/null
kill -TERM "${ray_pid}" 2>/dev/null && wait "${ray_pid}" 2>/dev/null
exit "${status}"
