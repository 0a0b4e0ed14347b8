"""Shared engines: a vLLM engine start costs 20-60 s on CPU, so each configuration
is started once per test session and reused."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Iterator

import pytest

from kvcompress.vllm_glue.engine_setup import cpu_worker_binding
from kvcompress.vllm_glue.llm import page_stats, shutdown  # noqa: F401  (page_stats: for the tests)

# Test and benchmark helpers (offline_assets, machine) live in benchmarks/common/, not in
# the installed package; the benchmark scripts import them as ``benchmarks.common.*`` from
# the repository root.
REPO_ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS_DIR = REPO_ROOT / "benchmarks"
if str(BENCHMARKS_DIR / "common") not in sys.path:
    sys.path.insert(0, str(BENCHMARKS_DIR / "common"))
if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def xdist_worker_core(worker: str | None, worker_count: int, cores: list[int]) -> str | None:
    """The cores a pytest-xdist worker's engines bind to (``VLLM_CPU_OMP_THREADS_BIND``):
    worker ``gwN`` of ``worker_count`` gets the N-th share of the usable cores, as
    ``cpu_worker_binding`` shares them among TP / DP ranks; more workers than cores share
    them round robin. None outside xdist. vLLM's own ``auto`` binding would put every
    worker's engine on the same cores."""
    if not worker or not worker.startswith("gw") or not cores:
        return None
    index = int(worker[2:])
    if worker_count > len(cores):
        return str(cores[index % len(cores)])
    return cpu_worker_binding(worker_count, cores, 0, "pytest-xdist").split("|")[index]


def pytest_addoption(parser):
    parser.addoption("--record-file-seconds", metavar="PATH", default=None,
                     help="after the run, write each test file's seconds (setup + call + teardown) into "
                          "PATH, merged with what it holds (tests/file_seconds.json orders the files)")


def pytest_collection_modifyitems(config, items):
    from suite_schedule import load_file_seconds, longest_files_first

    items[:] = longest_files_first(items, load_file_seconds())


_recorded = None  # FileSeconds while --record-file-seconds is on, in the controller only


def pytest_configure(config):
    global _recorded
    if config.getoption("--record-file-seconds") and not hasattr(config, "workerinput"):
        from suite_schedule import FileSeconds

        _recorded = FileSeconds()


def pytest_runtest_logreport(report):
    if _recorded is not None:
        _recorded.add(report.nodeid, report.duration)


def pytest_sessionfinish(session):
    if _recorded is not None and _recorded.seconds:
        _recorded.write(Path(session.config.getoption("--record-file-seconds")))


_core = xdist_worker_core(os.environ.get("PYTEST_XDIST_WORKER"),
                          int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), sorted(os.sched_getaffinity(0)))
XDIST_PINNED: set[int] | None = None  # the cores this xdist worker is pinned to
if _core is not None and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:  # a user's binding stands
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = _core
    # The worker and all it starts (engines, servers, compilers, its own torch threads) stay on
    # its share too: floating, they took turns on the other worker's engine core.
    XDIST_PINNED = {int(cpu) for cpu in _core.split(",")}
    os.sched_setaffinity(0, XDIST_PINNED)
    import torch

    torch.set_num_threads(len(XDIST_PINNED))

# Tiny random GQA Llama: 4 layers, 8 query heads, 2 KV heads, head dim 64.
TINY_LAYERS, TINY_KV_HEADS, TINY_HEAD_DIM = 4, 2, 64
# float32 KV bytes per token: layers x (K + V) x kv_heads x head_dim x 4.
TINY_BYTES_PER_TOKEN = TINY_LAYERS * 2 * TINY_KV_HEADS * TINY_HEAD_DIM * 4

# Small enough that the batch below does not fit at once: preemption is forced.
# Both engines get the same bytes (stock's 128-token blocks round it down to 1152).
TINY_ENGINE_ARGS = dict(
    skip_tokenizer_init=True,
    dtype="float32",
    enforce_eager=True,
    max_model_len=1024,
    max_num_seqs=8,
    max_num_batched_tokens=128,  # forces chunked prefill of every prompt > 128 tokens
    kv_cache_memory_bytes=1200 * TINY_BYTES_PER_TOKEN,
    seed=0,
)


def tiny_kv_budget(tokens: int, *, block_size: int, max_num_seqs: int, max_model_len: int,
                   identity_rows: bool = False) -> int:
    """KV memory bytes that leave a tiny-model kvcompress engine pages for ``tokens``
    uncompressed tokens after its per-head metadata (``vllm_glue/memory.py``): tests
    whose bounds are exact in the pool's size keep that size. ``identity_rows``: the
    metadata counted as the CPU engine lays it out, so the pool holds ``tokens`` and at
    most a page more; without, as CUDA's 8 B a slot, which leaves a CPU engine ~1.5% more."""
    from kvcompress.vllm_glue.memory import PerHeadLayout

    layout = PerHeadLayout(TINY_LAYERS, TINY_KV_HEADS, TINY_HEAD_DIM, 4, block_size, max_num_seqs,
                           max_model_len, max_num_seqs, identity_rows=identity_rows)
    pages_bytes = tokens * TINY_BYTES_PER_TOKEN + layout.page_bytes  # + a page: no rounding short
    budget = pages_bytes
    # The tables' sequence slots follow the memory (slots_for_memory): grow to a fixed point.
    while True:
        slots = layout.slots_for_memory(budget)
        fixed = layout.metadata_bytes(0, max_seqs=slots)
        per_page = layout.metadata_bytes(1, max_seqs=slots) - fixed
        needed = fixed + -(-pages_bytes * (layout.page_bytes + per_page) // layout.page_bytes)
        if needed <= budget:
            return budget
        budget = needed


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from offline_assets import tiny_llama_checkpoint

    return str(
        tiny_llama_checkpoint(
            num_layers=TINY_LAYERS, num_q_heads=8, num_kv_heads=TINY_KV_HEADS, head_dim=TINY_HEAD_DIM
        )
    )


@contextlib.contextmanager
def environment(**values: str | None) -> Iterator[None]:
    """Set (a string) or unset (None) environment variables for a block; restore after."""
    def apply(settings: dict[str, str | None]) -> None:
        for name, value in settings.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    previous = {name: os.environ.get(name) for name in values}
    try:
        apply(values)
        yield
    finally:
        apply(previous)


def greedy_tokens_and_logprobs(outputs) -> tuple[list[list[int]], list[list[float]]]:
    """Each request's tokens and the logprob of each (``SamplingParams(logprobs=0)``)."""
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [[step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                for o in outputs]
    return tokens, logprobs


def _shutdown(llm) -> None:
    try:
        shutdown(llm)  # collects even when the shutdown fails
    except Exception:
        pass


@pytest.fixture(scope="session")
def stock_tiny_llm(tiny_model):
    from vllm import LLM

    # Stats on: vllm:num_preemptions (stock's preemptions, against kvcompress's).
    llm = LLM(model=tiny_model, disable_log_stats=False, **TINY_ENGINE_ARGS)
    yield llm
    _shutdown(llm)


@pytest.fixture(scope="session")
def kvc_tiny_llm(tiny_model):
    import kvcompress

    llm = kvcompress.LLM(tiny_model, kv_compress_rate=1, **TINY_ENGINE_ARGS)
    yield llm
    _shutdown(llm)


def load_benchmark(name: str):
    """A fresh import of the script ``benchmarks/<group>/<name>.py`` (whichever group holds it)."""
    (path,) = [p for p in BENCHMARKS_DIR.glob(f"*/{name}.py") if p.parent.name != "gpu_e2e"]
    spec = importlib.util.spec_from_file_location(f"kvcompress_bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve string annotations through it
    spec.loader.exec_module(module)
    return module


def quality_rows(results: dict, **key) -> list[dict]:
    """The rows of an eval_quality result (``run_quality`` / ``main``) whose fields equal ``key``."""
    return [r for r in results["rows"] if all(r[k] == v for k, v in key.items())]


def worker_page_stats(llm) -> dict:
    """Worker-side page counters (model-runner process)."""
    return llm.collective_rpc("kvc_pages_used")[0]


@pytest.fixture(scope="module")
def setup_py():
    """The project's ``setup.py`` as a module (not ``__main__``: ``setup()`` does not run)."""
    path = Path(__file__).resolve().parents[1] / "setup.py"
    spec = importlib.util.spec_from_file_location("kvcompress_setup", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


@pytest.fixture
def cuda_platform():
    """A vLLM platform object that says CUDA (the CUDA engine setup, checked on CPU)."""
    from vllm.platforms.interface import Platform, PlatformEnum

    class CudaLikePlatform(Platform):
        _enum = PlatformEnum.CUDA
        device_name = "cuda"
        device_type = "cuda"

    return CudaLikePlatform()
