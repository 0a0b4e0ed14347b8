# One command to set up and run the tests, one to set up and run the demo (CPU).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup test demo clean

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

setup: $(PY)
	bash scripts/install_cpu.sh $(VENV)

test: setup
	$(PY) -m pytest -q tests

demo: setup
	$(PY) benchmarks/demo.py

clean:
	rm -rf $(VENV) build *.egg-info
