"""What keeps the project's Triton decode from compiling inside a CUDA-graph capture
(issue 56, item 7): vLLM runs one eager warm-up of each captured batch first. A
Triton module loaded while the stream is capturing fails ("operation not permitted
when stream is capturing"), so a vLLM that skipped the warm-up would stop kvcompress
engines at start, in ``profile_cudagraph_memory``. Checked on CPU against vLLM's own
config resolution and ``GPUModelRunner._warmup_and_capture``; that such a warm-up batch
takes the graph's decode path is ``tests/test_cuda_path.py::
test_warm_up_runs_the_capturable_decode_before_graph_capture``."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def graph_platform(monkeypatch):
    """vLLM's current platform answering as CUDA does about static graphs."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "support_static_graph_mode", classmethod(lambda cls: True))
    return current_platform


def test_graph_capturing_configs_warm_up_before_capture(graph_platform):
    from vllm.config import VllmConfig

    config = VllmConfig()
    assert config.compilation_config.cudagraph_mode.has_full_cudagraphs()
    assert config.compilation_config.cudagraph_num_of_warmups >= 1


def test_the_warm_up_is_an_eager_uniform_decode_run_with_attention(graph_platform, monkeypatch):
    from vllm.config import CUDAGraphMode, VllmConfig
    from vllm.forward_context import BatchDescriptor
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *args, **kwargs: None)

    class RecordingRunner:  # what _warmup_and_capture reads of its runner
        compilation_config = VllmConfig().compilation_config
        runs: list[dict] = []

        def _dummy_run(self, num_tokens, **kwargs):
            self.runs.append(kwargs)

    runner = RecordingRunner()
    descriptor = BatchDescriptor(num_tokens=4, num_reqs=4, uniform=True)
    GPUModelRunner._warmup_and_capture(runner, descriptor, cudagraph_runtime_mode=CUDAGraphMode.FULL)
    *warm_ups, capture = runner.runs
    assert warm_ups, "no eager run before the capture"
    first = warm_ups[0]
    assert first["cudagraph_runtime_mode"] == CUDAGraphMode.NONE
    assert first["force_attention"] and first["uniform_decode"]
    assert capture.get("is_graph_capturing") and capture["cudagraph_runtime_mode"] == CUDAGraphMode.FULL
