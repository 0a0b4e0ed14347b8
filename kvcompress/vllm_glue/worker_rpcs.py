"""The worker RPCs of a kvcompress engine (``LLM.collective_rpc`` / ``/collective_rpc``),
shared by the CPU and CUDA workers: each forwards to the per-head model runner
(``runner.PerHeadRunnerMixin``), where they are documented."""

from __future__ import annotations


class PerHeadWorkerRPCs:
    """Mixed into a vLLM worker whose ``model_runner`` is a per-head runner."""

    def kvcompress_pages_used(self) -> dict[str, int]:
        return self.model_runner.kvcompress_pages_used()

    def kvcompress_head_lens(self) -> dict[str, list]:
        return self.model_runner.kvcompress_head_lens()

    def kvcompress_page_dump(self) -> dict:
        return self.model_runner.kvcompress_page_dump()

    def kvcompress_kept_positions(self) -> dict[str, list[list[int]]]:
        return self.model_runner.kvcompress_kept_positions()

    def kvcompress_record_compressions(self, on: bool) -> dict[str, dict]:
        return self.model_runner.kvcompress_record_compressions(on)

    def kvcompress_defer_decode_metrics(self, batch: int) -> int:
        return self.model_runner.kvcompress_defer_decode_metrics(batch)
