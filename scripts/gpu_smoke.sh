#!/usr/bin/env bash
# The GPU path in one run (about 10 minutes on one NVIDIA GPU): the torch engine on CUDA
# through Triton, the in-process host where `tritonserver` imports, where `trtllm-build`
# exists a tiny TensorRT engine build and one request, and where TensorRT-LLM has its
# PyTorch backend the trtllm-pytorch target (LLM API, no engine build) answering
# through Triton. Prints a table per part; exits non-zero when a required step fails.
#
#   scripts/gpu_smoke.sh            # in the GPU image: docker run --gpus 1 ... scripts/gpu_smoke.sh
#   scripts/gpu_smoke.sh --pytest   # also the in-process host's integration tests
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_smoke: no NVIDIA GPU visible here (nvidia-smi -L fails); nothing to run" >&2
    exit 2
fi
# The project's venv where there is one (make venv), else this Python (the images).
python=python3
[ -x .venv/bin/python ] && python=.venv/bin/python
status=0
timeout --signal=INT --kill-after=30 480 "$python" -m bench.gpu_smoke "$@" || status=$?
timeout --signal=INT --kill-after=30 300 "$python" -m tests.gpu.smoke_llmapi || status=$((status ? status : $?))
exit "$status"
