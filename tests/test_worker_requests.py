"""The worker's live-request state (``worker_requests.py``, vLLM-free): slots placed and
released, per-slot facts, batch rows kept while the composition holds."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kvcompress.worker_requests import WorkerRequests


def _compression(compresses: bool):
    return SimpleNamespace(compresses=compresses)


def _requests():
    requests = WorkerRequests(max_seqs=6)
    requests.admit("a", _compression(True))
    requests.admit("b", _compression(False), prefix_hits=(7, 9))
    requests.admit("c", _compression(True))
    return requests


def test_place_and_release_keep_the_per_slot_facts():
    requests = _requests()
    requests.place("a", 3, computed=0, prompt_len=40)
    requests.place("b", 1, computed=32, prompt_len=50)
    assert requests.live_slots == {"a": 3, "b": 1} and requests["b"].seq_slot == 1
    assert requests.logical_lens[[3, 1]].tolist() == [0, 32] and requests.prompt_lens[[3, 1]].tolist() == [40, 50]
    assert requests.compresses[[3, 1]].tolist() == [True, False] and requests.shared_pages[1] == 2
    assert requests.placed(["a", "b", "c", "zz"]) == {"a": 3, "b": 1}  # c holds no slot yet
    assert requests.request_compresses("a") and not requests.request_compresses("b")
    assert not requests.request_compresses("zz") and requests.any_compresses()
    gone, slots = requests.release(["b", "c", "zz"])
    assert gone == ["b", "c"] and slots == [1] and requests.shared_pages[1] == 0
    assert "b" not in requests and len(requests) == 1 and requests.live_slots == {"a": 3}


def test_batch_rows_live_while_the_composition_holds():
    requests = _requests()
    placed = []

    def slot_for(request_id, computed):
        slot = 2 + len(placed)
        placed.append(request_id)
        requests.place(request_id, slot, computed, prompt_len=10)
        return slot

    rows = requests.batch_rows(["a", "c"], np.array([0, 0]), np.array([10, 10]), slot_for)
    assert placed == ["a", "c"] and rows.slots.tolist() == [2, 3] and rows.grown.tolist() == [10, 10]
    same = requests.batch_rows(["a", "c"], np.array([10, 10]), np.array([1, 1]), slot_for)
    assert same is rows and rows.grown.tolist() == [11, 11] and placed == ["a", "c"]
    # The per-slot counts are written back only when the composition ends.
    assert requests.logical_lens[[2, 3]].tolist() == [0, 0]
    other = requests.batch_rows(["c"], np.array([11]), np.array([1]), slot_for)
    assert other is not rows and requests.logical_lens[[2, 3]].tolist() == [11, 11]
    with pytest.raises(RuntimeError, match="request c has 5 computed tokens but its heads were grown for 12"):
        requests.batch_rows(["c"], np.array([5]), np.array([1]), slot_for)
    requests.drop_rows()
    assert requests.rows is None and requests.logical_lens[3] == 12
