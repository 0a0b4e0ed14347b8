"""benchmarks/bench_kernels.py is the one script a lent GPU session runs; its CPU dry run
(reference ops, tiny shapes) keeps it from rotting between such sessions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_kernels_cpu_dry_run_writes_a_clean_report(tmp_path):
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_kernels.py"), "--dry-run-cpu",
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
