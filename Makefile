# `make test` and `make demo` do all the set-up on a fresh machine: a .venv with torch
# (on a machine without one, `pip install torch==2.13.0`: the CPU build here, the CUDA build
# from PyPI elsewhere), Triton and this project with its test dependencies (and, for the demo,
# its demo extra).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.nnkernels-installed
DEMO_STAMP := $(VENV)/.nnkernels-demo-installed

.PHONY: test demo
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --durations=15

demo: $(DEMO_STAMP)
	$(VENV)/bin/nnkernels demo

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $@

$(DEMO_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[demo]'
	touch $@
