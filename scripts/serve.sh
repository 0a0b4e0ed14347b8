#!/usr/bin/env bash
# `make serve`: the OpenAI-compatible server on the cached SmolLM2-135M-Instruct (built
# from PyPI packages by benchmarks/common/offline_assets.py, no model hub) with compression on,
# on 127.0.0.1. Prints a curl and an openai-client example first.
# Environment: VENV (.venv), PORT (8000), RATE (8), KV_BYTES (KV memory, 1 GiB).
set -euo pipefail
VENV=${VENV:-.venv}
PORT=${PORT:-8000}
RATE=${RATE:-8}
KV_BYTES=${KV_BYTES:-1073741824}
MODEL=$("$VENV/bin/python" benchmarks/common/offline_assets.py smollm2 | tail -1)
BASE="http://127.0.0.1:$PORT/v1"
cat <<EOT
Starting vllm serve on $BASE (SmolLM2-135M-Instruct, --kv-compress-rate $RATE). Once it
says "Application startup complete", from another shell:

  curl $BASE/chat/completions -H 'Content-Type: application/json' -d '{
    "model": "smollm2", "max_tokens": 64,
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "vllm_xargs": {"kv_compress_rate": 4}}'

  $VENV/bin/python - <<'PY'
  from openai import OpenAI
  client = OpenAI(base_url="$BASE", api_key="none")
  reply = client.chat.completions.create(
      model="smollm2", max_tokens=64,
      messages=[{"role": "user", "content": "Name three planets."}],
      extra_body={"vllm_xargs": {"kv_compress_rate": 16, "kv_compress_policy": "snapkv"}},
  )
  print(reply.choices[0].message.content)
  PY

("vllm_xargs" sets compression per request: README, "Per request". Ctrl-C stops the server.)

EOT
exec env VLLM_TARGET_DEVICE=cpu "$VENV/bin/vllm" serve "$MODEL" --served-model-name smollm2 \
  --host 127.0.0.1 --port "$PORT" --dtype float32 --max-model-len 4096 \
  --kv-cache-memory-bytes "$KV_BYTES" --kv-compress-rate "$RATE"
