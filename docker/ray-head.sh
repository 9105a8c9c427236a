#!/usr/bin/env bash
# The Ray head as the container's main process, with this project's Serve app on it.
#
#   docker/ray-head.sh [python -m serve.deploy_config options, e.g. --gpus-per-replica 1]
#
# `ray start --block` stays in the foreground of this script until Ray's head
# processes exit; the script then exits with it, so the container stops (and
# restarts, under a restart policy) instead of idling on a dead Ray. The app is
# deployed once the head accepts `serve deploy`. SIGTERM or SIGINT (`docker stop`,
# through the container's init) stops Ray, and with it Serve, HAProxy and the Tritons.
#
# The Serve config is $SERVE_CONFIG (default: the image's serve/config.yaml; compose
# mounts the host's serve/ folder and points it there), adapted for a container by
# serve.deploy_config. It refuses an API without keys (TRITONLLM_API_KEYS) on every
# interface unless TRITONLLM_OPEN_API=1. docker/serve-deploy.sh deploys it again.
set -uo pipefail

ray start --head --port="${RAY_PORT:-6379}" --dashboard-host=0.0.0.0 --block &
ray_pid=$!
trap 'kill -TERM "$ray_pid" 2>/dev/null; wait "$ray_pid"; exit 0' TERM INT

config="${SERVE_CONFIG_OUT:-/tmp/serve.yaml}"
python3 -m serve.deploy_config --base "${SERVE_CONFIG:-serve/config.yaml}" "$@" -o "$config" \
    && python3 -m serve.launch --check-exposure "$config" \
    || { kill -TERM "$ray_pid"; wait "$ray_pid"; exit 2; }
# The dashboard (which `serve deploy` talks to) comes up a few seconds after the head.
deployed=0
for _ in $(seq 90); do
    kill -0 "$ray_pid" 2>/dev/null || break
    if serve deploy "$config"; then deployed=1; break; fi
    sleep 2
done
if [ "$deployed" != 1 ]; then
    echo "ray-head.sh: serve deploy did not succeed; stopping Ray" >&2
    kill -TERM "$ray_pid" 2>/dev/null
    wait "$ray_pid"
    exit 1
fi
wait "$ray_pid"
