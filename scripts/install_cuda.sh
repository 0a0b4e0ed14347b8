#!/usr/bin/env bash
# Install kvcompress into a Python that already has vLLM 0.32.0 with CUDA torch (the
# official vllm/vllm-openai:v0.32.0 image, or your own environment), building the CUDA
# extension kvcompress._C with the nvcc on PATH. Usage: scripts/install_cuda.sh [PYTHON]
# TORCH_CUDA_ARCH_LIST picks the GPU architectures (setup.py: default "8.0;9.0+PTX").
set -euo pipefail
PY=${1:-python3}
"$PY" -c "import vllm, torch; assert vllm.__version__.startswith('0.32.0'), vllm.__version__; \
assert torch.version.cuda, 'this torch has no CUDA'; print('vllm', vllm.__version__, 'torch', torch.__version__, 'cuda', torch.version.cuda)"
# Without build isolation: the extension builds against the torch vLLM brought. pip if
# this Python has it, else uv (vLLM's images install with `uv pip install --system`).
if "$PY" -m pip --version >/dev/null 2>&1; then
  KVCOMPRESS_BUILD_CUDA=1 "$PY" -m pip install --no-cache-dir --no-deps --no-build-isolation .
else
  KVCOMPRESS_BUILD_CUDA=1 uv pip install --python "$PY" --system --no-cache --no-deps --no-build-isolation .
fi
"$PY" -c "import kvcompress.patches as p; p.check_vllm_version(); import kvcompress._C; print('kvcompress installed with kvcompress._C')"
