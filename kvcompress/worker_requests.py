"""The worker's state of its live requests, vLLM-free (the scheduler's is
``page_accounting.py``): one :class:`WorkerRequest` per request, the facts the steps read
per sequence slot as arrays, the live requests' slots (the report's keys), and the running
batch's rows while its composition holds (``BatchRows``).

Slots are the rows of the page cache's tables: a request gets one at its first step
(``place``) and gives it back when it finishes, is preempted or resumes (``release``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

from kvcompress.contract import RequestCompression
from kvcompress.batch_rows import BatchRows


@dataclass
class WorkerRequest:
    """Worker-side state of one live request.

    Attributes:
        compression: its budget and policy, as the scheduler resolved them.
        seq_slot: its row in the cache's page tables (None until first placed); the
            tokens its heads were grown for are ``WorkerRequests.logical_lens[seq_slot]``
            (while its batch composition holds: ``WorkerRequests.rows.grown``).
        prefix_hits: the prefix-cache blocks its prompt starts with.
    """

    compression: RequestCompression
    seq_slot: int | None = None
    prefix_hits: tuple[int, ...] = ()


class WorkerRequests:
    """Live requests by id, and per sequence slot (``[max_seqs]`` numpy arrays): tokens
    its heads were grown for (``logical_lens``), its request's prompt tokens
    (``prompt_lens``), whether it is compressed (``compresses``) and its leading pages
    per head that are prefix-cache page groups (``shared_pages``)."""

    def __init__(self, max_seqs: int, device: torch.device | str = "cpu") -> None:
        self._by_id: dict[str, WorkerRequest] = {}
        self.logical_lens = np.zeros(max_seqs, dtype=np.int64)
        self.prompt_lens = np.zeros(max_seqs, dtype=np.int64)
        self.compresses = np.zeros(max_seqs, dtype=bool)
        self.shared_pages = np.zeros(max_seqs, dtype=np.int64)
        # request id -> sequence slot of every request holding pages (the report's keys).
        self.live_slots: dict[str, int] = {}
        # The running batch's rows while its composition holds (None: rebuild).
        self.rows: BatchRows | None = None
        self.device = device

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def __getitem__(self, request_id: str) -> WorkerRequest:
        return self._by_id[request_id]

    def __len__(self) -> int:
        return len(self._by_id)

    def get(self, request_id: str) -> WorkerRequest | None:
        return self._by_id.get(request_id)

    def admit(self, request_id: str, compression: RequestCompression, prefix_hits: tuple[int, ...] = ()) -> None:
        self._by_id[request_id] = WorkerRequest(compression, prefix_hits=prefix_hits)

    def request_compresses(self, request_id: str) -> bool:
        request = self._by_id.get(request_id)
        return request is not None and request.compression.compresses

    def any_compresses(self) -> bool:
        return any(request.compression.compresses for request in self._by_id.values())

    def placed(self, request_ids: Iterable[str]) -> dict[str, int]:
        """Request id -> slot of those of ``request_ids`` that hold a slot."""
        found = {}
        for request_id in request_ids:
            request = self._by_id.get(request_id)
            if request is not None and request.seq_slot is not None:
                found[request_id] = request.seq_slot
        return found

    def place(self, request_id: str, slot: int, computed: int, prompt_len: int) -> None:
        """``request_id`` holds ``slot`` from now on, its heads grown for ``computed`` tokens."""
        request = self._by_id[request_id]
        request.seq_slot = slot
        self.shared_pages[slot] = len(request.prefix_hits)
        self.logical_lens[slot] = computed
        self.prompt_lens[slot] = prompt_len
        self.compresses[slot] = request.compression.compresses
        self.live_slots[request_id] = slot

    def release(self, request_ids: Iterable[str]) -> tuple[list[str], list[int]]:
        """Forget the live ones of ``request_ids``: (their ids, the slots they held)."""
        gone = [r for r in request_ids if r in self._by_id]
        slots = [slot for slot in (self._by_id.pop(r).seq_slot for r in gone) if slot is not None]
        for request_id in gone:
            self.live_slots.pop(request_id, None)
        self.shared_pages[slots] = 0
        return gone, slots

    def batch_rows(self, req_ids, computed: np.ndarray, num_new: np.ndarray,
                   slot_for: Callable[[str, int], int]) -> BatchRows:
        """This step's rows (rebuilt when the batch's requests or their order changed;
        ``slot_for(request_id, computed)`` places a request without a slot), after
        checking each row's heads were grown for exactly its ``computed`` tokens; their
        heads are then grown for ``computed + num_new``."""
        rows = self.rows
        if rows is None or not rows.matches(req_ids):
            self.drop_rows()
            slots = []
            for request_id, done in zip(req_ids, computed.tolist()):
                request = self._by_id.get(request_id)
                slot = None if request is None else request.seq_slot
                slots.append(slot_for(request_id, done) if slot is None else slot)
            slots_np = np.asarray(slots, dtype=np.int64)
            rows = self.rows = BatchRows(
                req_ids=tuple(req_ids),
                slots=slots_np,
                seq_slots=torch.from_numpy(slots_np).to(self.device),
                prompt_lens=self.prompt_lens[slots_np],
                compresses=self.compresses[slots_np],
                grown=self.logical_lens[slots_np],
            )
        if not np.array_equal(rows.grown, computed):
            row = int(np.flatnonzero(rows.grown != computed)[0])
            raise RuntimeError(
                f"kvcompress: request {req_ids[row]} has {int(computed[row])} computed tokens "
                f"but its heads were grown for {int(rows.grown[row])}"
            )
        rows.grown = computed + num_new
        return rows

    def drop_rows(self) -> None:
        """End the batch composition: its rows' grown token counts go back to the
        per-slot array (kept in the rows while it held)."""
        rows = self.rows
        if rows is not None:
            self.logical_lens[rows.slots] = rows.grown
            self.rows = None
