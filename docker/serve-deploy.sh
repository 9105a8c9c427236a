#!/usr/bin/env bash
# Deploy the Serve config again to the Ray of this container, after a change of it:
#
#   docker compose -f docker/compose.yaml exec ray-head docker/serve-deploy.sh --gpus-per-replica 1
#
# The same steps as docker/ray-head.sh's first deploy ($SERVE_CONFIG adapted by
# serve.deploy_config with these options, the API keys checked, then `serve deploy`):
# Serve rolls the changed deployments over, draining requests in flight.
set -euo pipefail
config="${SERVE_CONFIG_OUT:-/tmp/serve.yaml}"
python3 -m serve.deploy_config --base "${SERVE_CONFIG:-serve/config.yaml}" "$@" -o "$config"
python3 -m serve.launch --check-exposure "$config"
serve deploy "$config"
echo "deployed $config; \`serve status\` shows the rollout"
