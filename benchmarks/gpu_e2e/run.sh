#!/usr/bin/env bash
# The GPU kit's device side (benchmarks/gpu_e2e/README.md): unpack vLLM 0.32.0's CUDA build
# from .gpu-kit/, install kvcompress without network, prove the compiled ops load on this
# machine's torch, then run the cases (e2e.py) into $OUT: setup.log, one log per case and
# results.json (at most 8 files).
#
#   bash benchmarks/gpu_e2e/run.sh              # the run (call 1 of the one-call layout)
#   bash benchmarks/gpu_e2e/run.sh stage        # layout two, call 1: keep the .so's first part
#   KIT_BUDGET_S=400 bash benchmarks/gpu_e2e/run.sh   # less time for the cases
#   KIT_CASES="graphs" bash benchmarks/gpu_e2e/run.sh  # only some cases (a rerun)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/kvc-gpu-out}
KIT=${KIT:-.gpu-kit}
SCRATCH=${KIT_SCRATCH:-/tmp/kvc-gpu-kit}
SITE=$SCRATCH/site
mkdir -p "$OUT" "$SCRATCH"
LOG=$OUT/setup.log
started=$(date +%s)
say() { echo "[run.sh +$(($(date +%s) - started))s] $*" | tee -a "$LOG"; }

if [ "${1:-run}" = stage ]; then
  cp "$KIT"/call1/so.xz.part-a "$SCRATCH"/ && say "staged $(du -h "$SCRATCH"/so.xz.part-a | cut -f1) in $SCRATCH"
  python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" 2>&1 | tee -a "$LOG"
  exit 0
fi

export PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export VLLM_USE_V2_MODEL_RUNNER=0 KVCOMPRESS_NO_CUDA=1 KVCOMPRESS_CACHE=$SCRATCH/cache
# FlashInfer does not travel; vLLM's CUDA sampler imports its backend unless told not to
# (topk_topp_sampler.flashinfer_sampler_supported; H200 run 2026-11-29).
export VLLM_USE_FLASHINFER_SAMPLER=0
# The commit kit.py recorded: the device's copy of the tree may carry a stale .git.
export KIT_TREE_COMMIT=$(cat "$KIT"/call1/tree-commit.txt 2>/dev/null)
{ nvidia-smi; python3 --version; } >> "$LOG" 2>&1

# 1. vLLM's Python and the missing dependencies.
site_xz=$(ls "$KIT"/call*/site.tar.xz 2>/dev/null | head -1)
if [ -z "$site_xz" ]; then say "no site.tar.xz under $KIT/call*/: carry the kit (make gpu-kit)"; exit 2; fi
# tar and xz, else Python's own tarfile / lzma (whichever the image has).
untar_xz() { tar -xJf "$1" -C "$2" 2>/dev/null || python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' "$1" "$2"; }
unxz_to() { xz -dc "$1" > "$2" 2>/dev/null || python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$1" "$2"; }
rm -rf "$SITE" && mkdir -p "$SITE" && untar_xz "$site_xz" "$SITE" || { say "unpacking $site_xz failed"; exit 2; }
say "unpacked $site_xz ($(du -sh "$SITE" | cut -f1))"
# FlashAttention's extensions (_vllm_fa2_C / _vllm_fa3_C) do not travel, and vLLM 0.32's
# vllm_flash_attn/__init__.py raises ImportError without them; fa_utils imports it on CUDA for
# every model (llama -> layers.attention -> mm_encoder_attention -> fa_utils), so model
# inspection failed on the H200 (2026-11-29). Without the raise, FA is reported unsupported
# (flash_attn_interface's FA2/FA3_AVAILABLE stay False) and TRITON_ATTN / CUSTOM never call it.
python3 - "$SITE"/vllm/vllm_flash_attn/__init__.py <<'EOF' 2>&1 | tee -a "$LOG"
import sys
path = sys.argv[1]
text = open(path).read()
guard = "if not (FA2_AVAILABLE or FA3_AVAILABLE):"
assert text.count(guard) == 1, f"{path}: FlashAttention guard not found"
open(path, "w").write(text.replace(guard, "if False:  # kvcompress GPU kit: no FlashAttention travels"))
print("vllm_flash_attn: import guard disabled (no FlashAttention extensions in the kit)")
EOF

# 2. vLLM's compiled ops: the Hopper-only .so (layout one), the whole one from two parts
#    (layout two), else a stub and vLLM's PyTorch ops.
SO=$SITE/vllm/_C_stable_libtorch.abi3.so
VARIANT=stub
if [ -f "$KIT"/call1/vllm_C_sm90.so.xz ]; then
  unxz_to "$KIT"/call1/vllm_C_sm90.so.xz "$SO" && VARIANT=real
elif [ -f "$SCRATCH"/so.xz.part-a ] && [ -f "$KIT"/call2/so.xz.part-b ]; then
  cat "$SCRATCH"/so.xz.part-a "$KIT"/call2/so.xz.part-b > "$SCRATCH"/so.xz && unxz_to "$SCRATCH"/so.xz "$SO" && VARIANT=real
fi
use_stub() { rm -f "$SO"; echo "# kvcompress GPU kit: no compiled ops (stub)" > "$SITE"/vllm/_C_stable_libtorch.py; VARIANT=stub; }
[ "$VARIANT" = real ] || use_stub
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}

# 3. kvcompress, no network (the vllm.general_plugins entry point needs an install).
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >> "$LOG" 2>&1 \
  || { say "pip install -e . failed (setup.log)"; exit 2; }

# 4. The ABI check: vLLM's stable-ABI ops on this torch, one real kernel against PyTorch.
check='import torch, vllm._C_stable_libtorch
x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16); w = torch.ones(256, device="cuda", dtype=torch.bfloat16)
out = torch.empty_like(x); torch.ops._C.rms_norm(out, x, w, 1e-6)
ref = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
err = (out.float() - ref).abs().max().item(); assert err < 0.05, err; print("vllm._C rms_norm ok, max err", err)'
if [ "$VARIANT" = real ]; then
  if ! timeout 180 python3 -c "$check" >> "$LOG" 2>&1; then
    say "the real .so did not load or run (setup.log): falling back to the stub"; use_stub
  fi
fi
timeout 240 python3 -c "import vllm, kvcompress; from vllm.platforms import current_platform as p; print('vllm', vllm.__version__, p.device_name, p.is_cuda())" >> "$LOG" 2>&1 \
  || { say "import vllm failed (setup.log)"; exit 2; }
# Preflight: the modules the CUDA path imports on the way to a first step, each tried on its
# own, so that one call names every missing package (a case stops at its first).
timeout 120 python3 - >> "$LOG" 2>&1 <<'EOF'
import importlib
for name in ("vllm.model_executor.models.llama", "vllm.v1.worker.gpu_model_runner",
             "vllm.v1.worker.gpu_worker", "vllm.v1.attention.backends.triton_attn",
             "vllm.model_executor.layers.quantization.online.base", "vllm.v1.sample.sampler",
             "vllm.model_executor.model_loader.dummy_loader", "vllm.v1.cudagraph_dispatcher",
             "vllm.compilation.cuda_graph", "kvcompress.vllm_glue.attention_backend",
             "kvcompress.vllm_glue.runner", "kvcompress.vllm_glue.gpu_worker",
             "kvcompress.ops.triton_attention", "kvcompress.ops.triton_move_cache"):
    try:
        importlib.import_module(name)
        print("preflight ok  ", name)
    except Exception as e:  # noqa: BLE001 -- every failure is the finding
        print("preflight FAIL", name, f"{type(e).__name__}: {e}")
EOF
grep "preflight FAIL" "$LOG" | sed 's/^/[run.sh] /'
say "variant $VARIANT; setup done"

# 5. The cases, within what is left of the call (600 s at most).
left=$(( ${KIT_CALL_S:-590} - ($(date +%s) - started) ))
budget=${KIT_BUDGET_S:-$left}
cases=${KIT_CASES:+--cases $KIT_CASES}
python3 benchmarks/gpu_e2e/e2e.py run --out "$OUT" --variant "$VARIANT" --budget-s "$budget" $cases 2>&1 | tee -a "$LOG"
status=${PIPESTATUS[0]}
say "e2e.py exited with $status"
exit "$status"
