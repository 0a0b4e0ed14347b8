"""Benchmarks and evaluation scripts, grouped by what they measure (not installed).

- ``common/``: helpers every group shares — offline models and texts (``offline_assets``),
  the host description (``machine``), plots (``plots``), the engine arguments of the
  SmolLM2 runs (``engine_args``) and adding token prompts to an engine (``engine_requests``).
  The tests import ``offline_assets`` and ``machine`` from here too.
- ``throughput/``: stock vLLM vs kvcompress at one KV memory (tokens/s, max batch,
  ``vllm bench serve``, prefix caching, a decode step, profiles, prefill cost per policy).
- ``quality/``: answers and perplexity under eviction (RULER-style eval, passkey, rankings,
  Hugging Face harnesses, the kvc-defaults search, XKV profiles).
- ``serving/``: ``vllm serve`` end to end (the demo, the soak, distributed layouts).
- ``kernels/``: kernel checks and timings (CUDA / Triton on a GPU; vLLM's CPU kernel).
- ``gpu_e2e/``: the air-gapped GPU kit.
- ``results/``: what the scripts wrote, with the machine they ran on (``results/README.md``).

Each script runs as a file (``python benchmarks/<group>/<script>.py``): it puts the
repository root on ``sys.path`` and imports its neighbours as ``benchmarks.<group>.<module>``.
"""
