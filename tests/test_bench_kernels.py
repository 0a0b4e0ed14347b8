"""benchmarks/kernels/bench_kernels.py is the one script a lent GPU session runs; its CPU dry run
(reference ops, tiny shapes) keeps it from rotting between such sessions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_kernels_cpu_dry_run_writes_a_clean_report(tmp_path):
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "kernels" / "bench_kernels.py"), "--dry-run-cpu",
         "--out-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    reports = list(tmp_path.glob("kernels-cpu-dry-run-*.json"))
    assert len(reports) == 1 and reports[0].with_suffix(".md").is_file()
    report = json.loads(reports[0].read_text())
    assert report["errors"] == []
    # The reference checks ran against the dense oracle and passed.
    assert report["checks"] and all(check["ok"] for check in report["checks"])
    assert report["decode"] and all(row["reference_ms"] > 0 for row in report["decode"])
    # The eviction section freed pages through the real compress_sequences.
    assert report["eviction"]["pages_freed"] > 0
    assert report["move_cache"]["reference"]["GBps"] > 0


def test_staged_vllm_sources_give_the_gpu_machine_vllms_triton_kernel(tmp_path):
    """scripts/stage_vllm_sources.sh copies vLLM's Python sources (what a GPU machine
    without vLLM gets with ``--vllm-path``): from that copy alone, vLLM imports, its
    platform stays CPU, and bench_kernels loads the Triton unified attention."""
    staged = tmp_path / "vllm_sources"
    done = subprocess.run(["bash", str(ROOT / "scripts" / "stage_vllm_sources.sh"), sys.prefix, str(staged)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (staged / "vllm" / "__init__.py").is_file() and not list(staged.rglob("*.so"))  # Python only
    size = sum(f.stat().st_size for f in staged.rglob("*") if f.is_file())
    assert size < 40 * 2**20, size  # the GPU machine takes 64 MiB with the repository
    probe = (
        "import sys; from pathlib import Path; sys.path.insert(0, 'benchmarks/kernels');"
        "import bench_kernels as bk;"
        f"reason = bk.load_vllm_unified(Path({str(staged)!r}));"
        "import vllm; from vllm.platforms import current_platform;"
        "print(reason, vllm.__file__, current_platform.device_type)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    reason, vllm_file, device_type = run.stdout.split()[-3:]
    assert reason == "None" and vllm_file.startswith(str(staged)) and device_type == "cpu", run.stdout


def test_stock_vs_kvcompress_sections_run_vllms_kernel_under_the_interpreter():
    """The GPU sections that time stock vLLM's kernel beside kvcompress's (decode at rates
    1 and 4, steps with prompt rows), on tiny shapes through Triton's interpreter: every
    row timed, and the one flattened call equal to a call per KV head."""
    script = (
        "import os, sys; os.environ['TRITON_INTERPRET'] = '1'; sys.path.insert(0, 'benchmarks/kernels');"
        "import json, torch; import bench_kernels as bk;"
        "assert bk.load_vllm_unified(None) is None;"
        "timer = bk.Timer(torch.device('cpu'), iters=1, warmup=0);"
        "shapes = dict(bk.LLAMA, num_q_heads=4, num_kv_heads=2, head_dim=32);"
        "decode = bk.bench_vllm_parity(torch.device('cpu'), timer, torch.float32, [1, 3], [40], [1, 4], 0.9,"
        " False, False, shapes=shapes);"
        "prompt = bk.bench_vllm_prompt_steps(torch.device('cpu'), timer, torch.float32, 0.9, shapes=shapes,"
        " steps=((8, 40, 0), (5, 30, 3)));"
        "print(json.dumps({'decode': decode, 'prompt': prompt}))"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=900,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(rows["decode"]) == 4 and len(rows["prompt"]) == 2
    for row in rows["decode"]:
        assert "error" not in row, row
        assert row["stock_ms"] > 0 and row["vllm_triton_ms"] > 0 and row["vllm_triton_rel_error"] < 1e-5, row
    for row in rows["prompt"]:
        assert "error" not in row, row
        assert row["stock_ms"] > 0 and row["rate1_ms"] > 0 and row["rate8_ms"] > 0, row
        assert row["one_call_vs_per_head_max_diff"] < 1e-6, row
        assert row["per_step_vs_per_call_starts_max_diff"] == 0, row
        assert all(row[f"{run}_pipe_ms"] > 0 for run in ("stock", "rate1", "rate1_copy", "rate8")), row
