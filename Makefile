# The index of what a person can do with this repo. `make help` lists the targets.
SHELL := /bin/bash
VENV ?= .venv
PY := $(if $(wildcard $(VENV)/bin/python),$(VENV)/bin/python,python3)
CONFIG ?= recipes/smoke.yaml
ARGS ?=

.PHONY: help install test test-all test-gpu gpu-checks gpu-bench gpu-cp bench-recipes bench-lm-head lint format bench-attention bench-linears bench smoke-test generate chat compare profile inspect-data estimate-memory verify-packing clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

$(VENV)/bin/python:
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	# torch first: a pinned release that satisfies requirements.txt, so pip does not pull another build
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -r requirements-dev.txt
	# the repo itself, editable and without dependencies: its packages import from anywhere, scripts run either way
	$(VENV)/bin/pip install -q --no-deps -e .

install: $(VENV)/bin/python  ## create .venv with the pinned requirements (skipped when it exists)

test: install  ## the fast tier (a few minutes on 2 cores): every module, kernels under TRITON_INTERPRET=1 on small shapes
	$(VENV)/bin/python -m pytest -q -m "not slow" tests

test-all: test  ## `make test`, then the slow tier (multi-process runs, inductor, kill -9 resume, script end-to-end runs)
	$(VENV)/bin/python -m pytest -q -m slow tests

test-gpu:  ## run only the GPU-marked tests (on a CUDA machine, with the system python)
	$(PY) -m pytest -q -m gpu tests

gpu-checks:  ## every GPU correctness check on one GPU: GPU tests, packed == per-sample per family, smoke run (artifacts/gpu-checks)
	bash scripts/gpu_checks.sh artifacts/gpu-checks

gpu-bench:  ## the benchmarks on one GPU: kernels, packing, fused vs unfused end to end (artifacts/gpu-bench)
	bash scripts/gpu_benchmarks.sh artifacts/gpu-bench

gpu-cp:  ## context parallelism on two GPUs: GPU tests, CP=2 vs CP=1 exactness, speed, attention engines (artifacts/gpu-cp)
	bash scripts/gpu_context_parallel.sh artifacts/gpu-cp

bench-recipes:  ## the shipped recipes at full size as shipped vs the eager fp32 path into docs/results/recipes-<date>.json (GPU; STAGE=one-gpu|two-gpu|moe; resumable, artifacts/gpu-bench-recipes)
	ARGS="$(ARGS)" bash scripts/gpu_bench_recipes.sh artifacts/gpu-bench-recipes $(or $(STAGE),all)

bench-lm-head:  ## step time with the loss over the labelled rows vs every row, on a recipe's packs (GPU; CONFIG=recipes/bench-...)
	$(PY) -m scripts.bench_lm_head --config $(CONFIG) $(ARGS)

lint: install  ## ruff, line length 120
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install  ## apply ruff's fixes and formatting
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench-attention:  ## the packed attention engines (fa2, fa4, FlexAttention) on the recipes' shapes, with errors against fp32 (GPU)
	$(PY) -m scripts.bench_attention --out artifacts/bench/attention.json $(ARGS)

bench-linears:  ## float8 linears (torchao) against bf16 on the recipes' layer shapes, compiled (GPU)
	$(PY) -m scripts.bench_fp8 --out artifacts/bench/fp8.json $(ARGS)

bench:  ## kernel benchmark against HF eager, torch.compile, Liger and the copy floor (GPU)
	$(PY) -m scripts.bench_mrope --out artifacts/bench/bench_mrope.json

smoke-test:  ## set up if needed, then train the tiny model on the built-in data (one GPU with fused rope, else a smaller CPU run) and print a summary
	$(PY) -m scripts.smoke_test $(ARGS)

generate:  ## answer and score held-out questions with a run (RUN=runs/smoke; ARGS="--data eval.jsonl ..."): predictions + summary
	$(PY) -m scripts.generate --run $(or $(RUN),runs/smoke) $(ARGS)

chat:  ## talk to a trained run in the terminal (RUN=runs/smoke); image and video paths in a message are read
	$(PY) -m scripts.chat --run $(or $(RUN),runs/smoke) $(ARGS)

inspect-data:  ## summarise a recipe's data: kept/skipped samples, packs, efficiency, memory estimate
	$(PY) -m scripts.inspect_data --config $(CONFIG) $(ARGS)

estimate-memory:  ## a recipe's memory per GPU before it runs, and which GPUs and overrides fit (ARGS="--gpus 2 ...")
	$(PY) -m scripts.estimate_memory --config $(CONFIG) $(ARGS)

verify-packing:  ## packed vs per-sample forward+backward on a recipe's model and data
	$(PY) -m scripts.verify_packing --config $(CONFIG) $(ARGS)

compare:  ## wandb throughput comparison: fused vs unfused rope on the eager fp32 path (VARIANTS=shipped,shipped-unfused: as shipped, compiled)
	$(PY) -m scripts.compare_throughput --config $(CONFIG) --variants $(or $(VARIANTS),fused,unfused) $(ARGS)

profile:  ## torch.profiler on a few training steps: top kernels, device time by category, trace (artifacts/profile)
	$(PY) -m scripts.profile_step --config $(CONFIG) $(ARGS)

clean:  ## remove caches and run outputs (keeps .venv)
	rm -rf .pytest_cache .ruff_cache artifacts runs wandb
