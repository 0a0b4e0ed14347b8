"""`vllm serve MODEL --kv-compress --kv-compress-rate 1` over HTTP on 127.0.0.1 (real server)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.assets]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def server():
    from kvcompress.offline_assets import smollm2_checkpoint

    model = str(smollm2_checkpoint())
    port = _free_port()
    vllm_cli = Path(sys.executable).parent / "vllm"
    process = subprocess.Popen(
        [str(vllm_cli), "serve", model, "--host", "127.0.0.1", "--port", str(port),
         "--served-model-name", "smollm2", "--dtype", "float32", "--enforce-eager",
         "--max-model-len", "2048", "--kv-cache-memory-bytes", str(256 << 20),
         "--kv-compress", "--kv-compress-rate", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"}, start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"vllm serve exited: {process.stderr.read()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as response:
                if response.status == 200:
                    break
        except OSError:
            time.sleep(2)
    else:
        os.killpg(process.pid, signal.SIGTERM)
        raise RuntimeError("vllm serve did not become healthy in 300 s")
    yield base
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)


def test_chat_completion_answers(server):
    reply = _post(f"{server}/v1/chat/completions", {
        "model": "smollm2", "temperature": 0, "max_tokens": 24,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
    })
    assert "Paris" in reply["choices"][0]["message"]["content"]
    assert reply["usage"]["completion_tokens"] > 0


def test_completion_continues_text(server):
    reply = _post(f"{server}/v1/completions", {
        "model": "smollm2", "prompt": "The capital of France is", "temperature": 0,
        "max_tokens": 8,
    })
    text = reply["choices"][0]["text"]
    assert "Paris" in text and reply["usage"]["completion_tokens"] == 8
