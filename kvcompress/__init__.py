"""KV-Compress for vLLM 0.32: a per-(layer, KV head) paged KV cache.

``kvcompress.ops`` (the kernel layer) imports with torch alone; the vLLM glue
lives in ``kvcompress.vllm_glue`` and is loaded by vLLM's plugin system.
"""

from kvcompress.config import KVCompressConfig

__version__ = "0.1.0"
VLLM_VERSION = "0.32.0"

__all__ = ["KVCompressConfig", "LLM", "VLLM_VERSION", "__version__"]


def __getattr__(name: str):
    # vLLM is imported only when the thin LLM wrapper is used.
    if name == "LLM":
        from kvcompress.vllm_glue.llm import LLM

        return LLM
    raise AttributeError(name)
