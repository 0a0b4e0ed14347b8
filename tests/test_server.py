"""`vllm serve MODEL --kv-compress --kv-compress-rate 1 --kv-compress-policy pyramidkv` over
HTTP on 127.0.0.1 (real server); per-request rates and policies through `vllm_xargs`."""

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

from kvcompress.policies import POLICY_NAMES

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
    from offline_assets import smollm2_checkpoint

    model = str(smollm2_checkpoint())
    port = _free_port()
    vllm_cli = Path(sys.executable).parent / "vllm"
    process = subprocess.Popen(
        [str(vllm_cli), "serve", model, "--host", "127.0.0.1", "--port", str(port),
         "--served-model-name", "smollm2", "--dtype", "float32", "--enforce-eager",
         "--max-model-len", "2048", "--kv-cache-memory-bytes", str(256 << 20),
         "--kv-compress", "--kv-compress-rate", "1",
         "--kv-compress-policy", "pyramidkv", "--kv-compress-pyramid-beta", "10"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        # Dev mode serves /collective_rpc, through which the tests read worker page stats.
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_SERVER_DEV_MODE": "1"},
        start_new_session=True,
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


def _post_status(url: str, body: dict) -> tuple[int, dict]:
    import urllib.error

    try:
        return 200, _post(url, body)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


@pytest.mark.parametrize(
    "xargs,field",
    [
        ({"kv_compress_rate": 0.5}, "kv_compress_rate"),
        ({"kv_compress_rate": "fast"}, "kv_compress_rate"),
        ({"kv_compress_max_cache_tokens": 0}, "kv_compress_max_cache_tokens"),
        ({"kv_compress_protected_window": -3}, "kv_compress_protected_window"),
        ({"kv_compress": "perhaps"}, "kv_compress"),
        ({"kv_compress_ratio": 4}, "kv_compress_ratio"),
        ({"kv_compress_policy": "pyramidinfer"}, "kv_compress_policy"),
        ({"kv_compress_policy": 3}, "kv_compress_policy"),
    ],
)
def test_invalid_per_request_field_is_http_400_naming_it(server, xargs, field):
    status, body = _post_status(f"{server}/v1/completions", {
        "model": "smollm2", "prompt": "Hello", "max_tokens": 4, "vllm_xargs": xargs,
    })
    assert status == 400
    assert field in json.dumps(body)
    # The server keeps serving.
    with urllib.request.urlopen(f"{server}/health", timeout=10) as response:
        assert response.status == 200


def test_per_request_compression_over_http(server):
    """A long prompt compressed at rate 4 for this request only, then an uncompressed one."""
    from offline_assets import paul_graham_essays

    essay = paul_graham_essays()[0][:6000]
    for xargs in ({"kv_compress_rate": 4, "kv_compress_protected_window": 32}, {"kv_compress": False}):
        reply = _post(f"{server}/v1/completions", {
            "model": "smollm2", "prompt": essay + "\n\nIn one sentence, this essay is about",
            "temperature": 0, "max_tokens": 12, "vllm_xargs": xargs,
        })
        assert reply["usage"]["prompt_tokens"] > 1000
        assert reply["usage"]["completion_tokens"] == 12
        assert reply["choices"][0]["text"].strip()
    reply = _post(f"{server}/v1/chat/completions", {
        "model": "smollm2", "temperature": 0, "max_tokens": 24,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "vllm_xargs": {"kv_compress_rate": 2},
    })
    assert "Paris" in reply["choices"][0]["message"]["content"]


def _worker_stats(server: str) -> dict:
    reply = _post(f"{server}/collective_rpc", {"method": "kvcompress_pages_used"})
    return reply["results"][0]


@pytest.mark.parametrize("policy", list(POLICY_NAMES) + [None])
def test_every_policy_frees_pages_through_the_server(server, policy):
    """Each policy, chosen per request (None: the server's --kv-compress-policy
    pyramidkv), compresses a ~1.5K-token prompt at rate 4 and frees pages."""
    from offline_assets import paul_graham_essays

    name = policy or "pyramidkv"
    before = _worker_stats(server)
    xargs = {"kv_compress_rate": 4, "kv_compress_protected_window": 16}
    if policy is not None:
        xargs["kv_compress_policy"] = policy
    essay = paul_graham_essays()[1][:6000]
    reply = _post(f"{server}/v1/completions", {
        "model": "smollm2", "prompt": essay + "\n\nThe author's main point is",
        "temperature": 0, "max_tokens": 8, "vllm_xargs": xargs,
    })
    assert reply["usage"]["prompt_tokens"] > 1000 and reply["usage"]["completion_tokens"] == 8
    assert reply["choices"][0]["text"].strip()
    after = _worker_stats(server)
    freed = after["pages_freed_by_policy"].get(name, 0) - before["pages_freed_by_policy"].get(name, 0)
    prompt_pages = -(-reply["usage"]["prompt_tokens"] // 16) * 30 * 3  # SmolLM2: 30 layers x 3 KV heads
    # Rate 4 with a 128-token floor and a 16-token window keeps well under half.
    assert freed > prompt_pages // 2, (name, freed, prompt_pages)
    assert after["evict_mismatches"] == 0
    assert after["live_requests"] == 0
