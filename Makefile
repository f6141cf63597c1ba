# Set-up is part of every target: a fresh machine needs only python3 (3.10+) and make.
VENV   ?= .venv
PY     := $(VENV)/bin/python
# CPU build of torch from the local wheel store; on a GPU box install your CUDA torch first
# (torch >= 2.9: flex_attention's AuxRequest), then `make` leaves it alone.
TORCH  ?= torch==2.13.0

.PHONY: demo test bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/batchvlm run jobs/demo.yaml

test: $(VENV)/.installed
	$(PY) -m pytest -q -n auto --dist loadfile  # one worker per core, a test file per worker

bench: $(VENV)/.installed
	$(PY) scripts/bench_engine.py

clean:
	rm -rf $(VENV) jobs/out
