"""A CUDA engine without ``kvcompress._C`` says so at start, with the reason its build
recorded (issue 56): pip hides setup.py's output unless the build fails, so an isolated
``pip install -e .[cuda]`` (no torch in pip's build environment) skipped the extension
without a word the user could see."""

from __future__ import annotations

import importlib.util
import logging
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ISOLATED_BUILD_REASON = "torch is not importable in the build environment; install vLLM first"



def _load(path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("build_record_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_setup_records_whether_and_why_not_the_extension_was_built(setup_py, tmp_path):
    path = tmp_path / "_build_record.py"
    setup_py.record_build(setup_py.BuildPlan(False, ISOLATED_BUILD_REASON), path)
    record = _load(path)
    assert record.EXTENSION_BUILT is False and record.REASON == ISOLATED_BUILD_REASON
    setup_py.record_build(setup_py.BuildPlan(True, "CUDA 12.8, torch 2.9.0"), path)
    record = _load(path)
    assert record.EXTENSION_BUILT is True and record.REASON is None



@pytest.fixture
def notices(monkeypatch):
    """The engine setup's log records, and a process that has logged no notice yet."""
    from kvcompress.vllm_glue import engine_setup

    monkeypatch.delenv(engine_setup.V2_RUNNER_ENV, raising=False)
    monkeypatch.setattr(engine_setup, "_notices_logged", set())
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger(f"vllm.{engine_setup.__name__}")
    level = logger.level
    logger.setLevel(logging.INFO)  # the tests run vLLM's loggers at WARNING
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(level)


def _start_cuda_engine(platform) -> None:
    from vllm.engine.arg_utils import EngineArgs

    from kvcompress.vllm_glue.engine_setup import prepare_engine_args

    args = EngineArgs(model="unused", additional_config={"kvcompress": {"enabled": True, "rate": 8}})
    prepare_engine_args(args, platform=platform)
    prepare_engine_args(args, platform=platform)  # vLLM may build the config twice


def _missing_extension(monkeypatch, reason: str | None) -> None:
    from kvcompress.vllm_glue import engine_setup

    monkeypatch.setattr(engine_setup, "extension_installed", lambda: False)
    record = types.ModuleType("kvcompress._build_record")
    record.EXTENSION_BUILT, record.REASON = False, reason
    monkeypatch.setitem(sys.modules, "kvcompress._build_record", record)


def test_cuda_engine_without_the_extension_warns_once_with_the_recorded_reason(
    cuda_platform, notices, monkeypatch,
):
    _missing_extension(monkeypatch, ISOLATED_BUILD_REASON)
    _start_cuda_engine(cuda_platform)
    assert [(r.levelno, r.getMessage()) for r in notices] == [(
        logging.WARNING,
        f"kvcompress._C not built: CUDA engines use the Triton kernels; reason: {ISOLATED_BUILD_REASON}",
    )]


def test_extension_turned_off_on_purpose_is_only_noted(cuda_platform, notices, monkeypatch):
    _missing_extension(monkeypatch, "KVCOMPRESS_NO_CUDA=1")
    _start_cuda_engine(cuda_platform)
    assert [r.levelno for r in notices] == [logging.INFO]
    assert "KVCOMPRESS_NO_CUDA=1" in notices[0].getMessage()


def test_no_notice_where_the_extension_is_installed_or_the_engine_runs_on_cpu(
    cuda_platform, notices, monkeypatch,
):
    from vllm.platforms.interface import Platform, PlatformEnum

    from kvcompress.vllm_glue import engine_setup

    monkeypatch.setattr(engine_setup, "extension_installed", lambda: True)
    _start_cuda_engine(cuda_platform)

    class CpuLikePlatform(Platform):
        _enum = PlatformEnum.CPU
        device_name = "cpu"

    _missing_extension(monkeypatch, ISOLATED_BUILD_REASON)
    _start_cuda_engine(CpuLikePlatform())
    assert notices == []
