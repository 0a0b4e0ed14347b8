"""KV-Compress for vLLM 0.32: a per-(layer, KV head) paged KV cache.

``kvcompress.ops`` (the kernel layer) imports with torch and numpy alone: a GPU machine
without vLLM or pydantic runs ``benchmarks/kernels/bench_kernels.py``. The vLLM glue lives in
``kvcompress.vllm_glue`` and is loaded by vLLM's plugin system.
"""

__version__ = "0.1.0"
VLLM_VERSION = "0.32.0"

__all__ = ["KVCompressConfig", "LLM", "VLLM_VERSION", "__version__"]


def __getattr__(name: str):
    # pydantic (the config) and vLLM (the LLM wrapper) load only when asked for.
    if name == "KVCompressConfig":
        from kvcompress.config import KVCompressConfig

        return KVCompressConfig
    if name == "LLM":
        from kvcompress.vllm_glue.llm import LLM

        return LLM
    raise AttributeError(name)
