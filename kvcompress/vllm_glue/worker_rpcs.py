"""The worker RPCs of a kvcompress engine (``LLM.collective_rpc`` / ``/collective_rpc``),
shared by the CPU and CUDA workers: each reads or switches the per-head model runner
through ``diagnostics.py``, where they are documented."""

from __future__ import annotations

from kvcompress.vllm_glue import diagnostics


class KVCompressWorkerRPCs:
    """Mixed into a vLLM worker whose ``model_runner`` is a per-head runner."""

    def kvc_pages_used(self) -> dict[str, int]:
        return diagnostics.pages_used(self.model_runner)

    def kvc_head_lens(self) -> dict[str, list]:
        return diagnostics.head_lens(self.model_runner)

    def kvc_page_dump(self) -> dict:
        return diagnostics.page_dump(self.model_runner)

    def kvc_kept_positions(self) -> dict[str, list[list[int]]]:
        return diagnostics.kept_positions(self.model_runner)

    def kvc_record_compressions(self, on: bool) -> dict[str, dict]:
        return diagnostics.record_compressions(self.model_runner, on)

    def kvc_defer_decode_metrics(self, batch: int) -> int:
        return diagnostics.defer_decode_metrics(self.model_runner, batch)
