"""CI-sized soak (`benchmarks/serving/soak.py`): `vllm serve --kv-compress --kv-compress-rate 8` on
the tiny model under KV pressure, 60 requests of the mixed load at concurrency 6 (streams,
cancels, sampled with and without seeds on chunked prompts, n > 1, logprobs,
prompt_logprobs, stop token ids, min_tokens, bad requests, per-request `vllm_xargs`
over every policy). Every answer well-formed, nothing hung, every page free at idle, no
page-mismatch line in the server log, the server's whole process group gone after
SIGTERM."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvcompress.policies import POLICY_NAMES

pytestmark = [pytest.mark.engine, pytest.mark.assets]

SOAK = Path(__file__).resolve().parents[1] / "benchmarks" / "serving" / "soak.py"


@pytest.fixture(scope="module")
def soak_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("soak")
    report_path, log_path = out / "soak.json", out / "server.log"
    # The harness picks a free port itself (bound to 127.0.0.1 by the OS, like
    # test_server.py's) and bounds every phase; the outer timeout is a last resort.
    command = [
        sys.executable, str(SOAK), "--model", "tiny", "--requests", "60", "--concurrency", "6",
        "--kv-compress-rate", "8", "--max-tokens", "16", "--time-limit", "180",
        "--startup-timeout", "300", "--seed", "1",
        "--json", str(report_path), "--log", str(log_path), "--quiet",
        "--markdown", str(out / "soak.md"),
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=900)
    if not report_path.exists():
        pytest.fail(f"soak.py wrote no report (exit {completed.returncode}):\n"
                    f"{completed.stderr[-4000:]}\n{log_path.read_text(errors='replace')[-4000:] if log_path.exists() else ''}")
    report = json.loads(report_path.read_text())
    report["exit_code"] = completed.returncode
    report["stdout"] = completed.stdout
    report["out"] = out
    return report


def test_report_table_plot_and_summary_line(soak_report):
    out = soak_report["out"]
    assert "| wall time of the load |" in (out / "soak.md").read_text()
    assert (out / "soak.png").stat().st_size > 5_000  # palette PNG: empty axes are ~4 KB
    last = soak_report["stdout"].strip().splitlines()[-1]
    ok = soak_report["summary"]["outcomes"]["ok"]
    assert last.startswith(f"summary: ok {ok}, ")
    assert last.endswith("all checks passed") == (soak_report["exit_code"] == 0), last


def test_every_answer_is_well_formed(soak_report):
    outcomes = soak_report["summary"]["outcomes"]
    assert outcomes["error"] == 0 and outcomes["hung"] == 0 and outcomes["not_sent"] == 0, (
        soak_report["summary"]["failures"])
    assert outcomes["ok"] >= 40
    assert outcomes["cancelled"] > 0
    assert sum(outcomes.values()) == 60


def test_the_mix_covers_the_features(soak_report):
    by_tag = soak_report["summary"]["by_tag"]
    for tag in ("stream", "cancel", "sampled", "seeded", "seeded+chunked", "n>1", "logprobs",
                "min_tokens", "stop", "xargs", "chunked"):
        assert tag in by_tag, (tag, sorted(by_tag))


def test_compression_happened_under_pressure(soak_report):
    pages = soak_report["pages"]
    before, after = pages["worker_before"], pages["worker_after"]
    assert after["compressions"] - before["compressions"] > 10
    assert after["pages_freed"] - before["pages_freed"] > 0
    freed_by = set(after["pages_freed_by_policy"])
    assert len(freed_by & set(POLICY_NAMES)) >= 4, freed_by


def test_all_pages_free_at_idle_and_no_mismatch(soak_report):
    pages = soak_report["pages"]
    assert pages["idle"]
    after = pages["worker_after"]
    assert after["live_requests"] == 0 and after["held_by_live_requests"] == 0
    assert after["num_free"] == pages["worker_before"]["num_free"]
    assert after["evict_mismatches"] == 0
    assert pages["scheduler_usage_at_idle"] == 0
    log = soak_report["log"]
    assert log["mismatch_lines"] == 0, log["error_kinds"]
    # Every other ERROR event during the load is vLLM's one per request answered 400.
    assert log["other_error_events"] == 0, log["error_kinds"]
    assert log["request_error_events"] == soak_report["summary"]["outcomes"]["bad_request_expected"]


def test_server_stopped_cleanly(soak_report):
    stop = soak_report["stop"]
    assert stop["left_after_sigterm"] == [] and stop["left_after_sigkill"] == []
    assert soak_report["failed_checks"] == []
    assert soak_report["exit_code"] == 0, soak_report["stdout"][-3000:]
