#!/usr/bin/env bash
# `make test` after its venv and Redis: the unit tests while the integration tests'
# environments install (virtualenvs of their own, mostly download and unpacking; their
# output goes to build/test-envs.log, shown if one fails), then the integration tests.
# Arguments go to both pytest runs; pytest's exit 5 (nothing selected: arguments naming
# a file of one kind only) counts as a pass. Exits with the first failure's status.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
MAKE=${MAKE:-make}
mkdir -p build

"$MAKE" --no-print-directory -j3 vllm-env aiperf-env lm-eval-env >build/test-envs.log 2>&1 &
envs=$!
trap 'kill "$envs" 2>/dev/null' EXIT

"$PY" -m pytest -m 'not integration' "$@"
unit=$?
if ! wait "$envs"; then
    cat build/test-envs.log
    echo "make test: the integration tests' environments did not install (above)" >&2
    exit 1
fi
"$PY" -m pytest -m integration "$@"
integration=$?

for status in "$unit" "$integration"; do
    if [ "$status" -ne 0 ] && [ "$status" -ne 5 ]; then
        exit "$status"
    fi
done
