# One command to set up and run the tests, one to set up and run the demo (CPU).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup test demo serve bench eval clean

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

setup: $(PY)
	bash scripts/install_cpu.sh $(VENV)

test: setup
	$(PY) -m pytest -q --durations=25 tests

# Stock vLLM vs kvcompress at rates 1/4/8 on SmolLM2 long-document questions, same KV memory
# (~2 min after setup): KV per request, concurrent requests, tokens/s, answers; demo-smollm2.{md,json,png}.
demo: setup
	$(PY) benchmarks/demo.py

# The OpenAI-compatible server on SmolLM2 with compression (prints curl / openai examples).
serve: setup
	VENV=$(VENV) bash scripts/serve.sh

# Throughput + max decode batch vs stock vLLM (tiny model, ~8 min on 2 CPU cores).
bench: setup
	$(PY) benchmarks/benchmark_throughput.py

# Quality suite (SmolLM2-135M, RULER-style tasks) as % of the full cache; EVAL_ARGS=--limit 1 for a quick run.
eval: setup
	$(PY) benchmarks/eval_quality.py $(EVAL_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
