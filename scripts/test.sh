#!/usr/bin/env bash
# `make test` after its venv and Redis: the unit tests while the integration tests'
# environments install (virtualenvs of their own, mostly download and unpacking; their
# output goes to build/test-envs.log, shown if one fails), then the integration tests.
#
# The integration tests run in two pytest runs side by side, whose output interleaves
# (each line prefixed with its part): the modules that start their own clusters and
# stacks, and those on one session cluster (tests/integration/conftest.py). They wait on
# process starts much of their time, so on two cores the pair takes about two thirds
# of one run after the other. Then the `quiet` modules, whose checks bound times, with
# nothing beside them. The repositories are built first, once, for all of them.
#
# Arguments go to every pytest run; pytest's exit 5 (nothing selected: arguments naming
# a file of one kind only) counts as a pass. Ends with a summary of every stage's status
# and its failed tests (a CI log shows its tail), and exits with the first failure's.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
MAKE=${MAKE:-make}
mkdir -p build

"$MAKE" --no-print-directory -j3 vllm-env aiperf-env lm-eval-env >build/test-envs.log 2>&1 &
envs=$!
pids=("$envs")
trap 'kill "${pids[@]}" 2>/dev/null' EXIT

stages=()
statuses=()
# A pytest run of one stage, its output also in build/test-STAGE.log for the summary.
stage() {
    local name=$1
    shift
    "$PY" -m pytest "$@" 2>&1 | tee "build/test-$name.log"
    statuses+=("${PIPESTATUS[0]}")
    stages+=("$name")
}
stage unit -m 'not integration' "$@"
if ! wait "$envs"; then
    cat build/test-envs.log
    echo "make test: the integration tests' environments did not install (above)" >&2
    exit 1
fi
"$PY" -c 'from tests.conftest import build_repository as llm, build_embedding_repository as e
llm(); e()' || exit 1

# One part of the integration tests, its lines prefixed; its status in build/test-PART.rc,
# its output in build/test-PART.log.
part() {
    local name=$1
    shift
    (PYTHONUNBUFFERED=1 "$PY" -m pytest -m 'integration and not quiet' \
        --integration-part "$name" "$@" 2>&1; echo $? >"build/test-$name.rc") |
        tee "build/test-$name.log" | sed -u "s/^/$name | /"
}
rm -f build/test-own-stacks.rc build/test-session-cluster.rc  # a part that dies writes none
part own-stacks "$@" &
pids+=($!)
part session-cluster "$@" &
pids+=($!)
wait "${pids[@]:1}"
for name in own-stacks session-cluster; do
    statuses+=("$(cat "build/test-$name.rc" 2>/dev/null || echo 1)")
    stages+=("$name")
done
stage quiet -m 'integration and quiet' "$@"

echo "make test: summary"
failure=0
for i in "${!stages[@]}"; do
    status=${statuses[$i]}
    echo "  ${stages[$i]}: exit $status"
    if [ "$status" -ne 0 ] && [ "$status" -ne 5 ]; then
        grep -E '^(FAILED|ERROR) ' "build/test-${stages[$i]}.log" 2>/dev/null | sed 's/^/    /'
        [ "$failure" -ne 0 ] || failure=$status
    fi
done
exit "$failure"
