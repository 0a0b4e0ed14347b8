"""Two-level page tables (``ChunkedPageTables``) against a brute-force model: every head's
page list kept as a Python list, grown by prefill / chunked-prefill appends and decode
appends (numpy and torch paths), shrunk by compression and emptied by release."""

from __future__ import annotations

import random

import pytest
import torch

from kvcompress.ops import PerHeadPagedCache
from kvcompress.ops.page_tables import ChunkedPageTables, chunk_pages_for
from kvcompress.ops.paged_cache import pages_for


def _check(cache: PerHeadPagedCache, model: dict[int, list[list[list[int]]]]) -> None:
    """Tables, lengths and both allocators agree with the model's page lists."""
    block = cache.block_size
    chunk_pages = cache.tables.chunk_pages
    flat = cache.flat_page_tables()
    in_use, chunks_in_use = [], 0
    for slot, heads in model.items():
        for layer, row in enumerate(heads):
            for head, pages in enumerate(row):
                held = int(pages_for(int(cache.head_lens[slot, layer, head]), block))
                assert held == len(pages)
                assert flat[slot, layer, head, :held].tolist() == pages
                in_use += pages
                chunks_in_use += -(-held // chunk_pages)
    assert len(set(in_use)) == len(in_use), "a page is held twice"
    assert cache.allocator.num_used == len(in_use)
    assert cache.tables.chunk_allocator.num_used == chunks_in_use
    free = set(cache.allocator.free_stack[: cache.allocator.num_free].tolist())
    assert not free & set(in_use)


@pytest.mark.parametrize("host_views", [True, False], ids=["numpy", "torch"])
@pytest.mark.parametrize("max_pages", [1, 7, 40])
def test_chunked_tables_follow_a_brute_force_model(host_views, max_pages):
    rng = random.Random(max_pages * 2 + host_views)
    layers, heads, block, max_seqs = 2, 3, 4, 5
    cache = PerHeadPagedCache(400, layers, heads, block, max_seqs=max_seqs, max_pages_per_head=max_pages)
    if not host_views:
        cache.host = None
    assert cache.tables.chunk_pages == chunk_pages_for(max_pages)
    model: dict[int, list[list[list[int]]]] = {}
    limit = max_pages * block
    for _ in range(300):
        action = rng.random()
        free_slots = max_seqs - len(model)
        if model and action < 0.1:  # release
            slot = rng.choice(sorted(model))
            freed = cache.release(torch.tensor([slot]))
            assert freed == sum(len(p) for row in model.pop(slot) for p in row)
        elif free_slots and (action < 0.3 or not model):  # a new sequence's prompt
            length = rng.randint(1, limit)
            if cache.allocator.num_free < layers * heads * max_pages:
                continue
            slot = cache.new_sequence()
            before = cache.flat_page_tables()
            cache.append(torch.tensor([slot]), torch.tensor([length]), torch.arange(length))
            after = cache.flat_page_tables()
            count = int(pages_for(length, block))
            model[slot] = [[after[slot, l, h, :count].tolist() for h in range(heads)] for l in range(layers)]
            del before
        elif action < 0.7:  # decode steps / chunks for some running sequences
            slots = [s for s in sorted(model) if int(cache.head_lens[s].max()) + 3 <= limit]
            if not slots or cache.allocator.num_free < len(slots) * layers * heads * 2:
                continue
            slots = rng.sample(slots, rng.randint(1, len(slots)))
            counts = [1] * len(slots) if rng.random() < 0.6 else [rng.randint(1, 3) for _ in slots]
            old_pages = {s: pages_for(cache.head_lens[s].clone(), block) for s in slots}
            positions = torch.cat([torch.arange(n) + 1000 for n in counts])
            plan = cache.append(torch.tensor(slots), torch.tensor(counts), positions)
            flat = cache.flat_page_tables()
            for s in slots:
                new_pages = pages_for(cache.head_lens[s], block)
                for l in range(layers):
                    for h in range(heads):
                        start, end = int(old_pages[s][l, h]), int(new_pages[l, h])
                        model[s][l][h] += flat[s, l, h, start:end].tolist()
            if all(n == 1 for n in counts):  # the decode path's write targets: each head's last slot
                for row, s in enumerate(slots):
                    for l in range(layers):
                        for h in range(heads):
                            last = int(cache.head_lens[s, l, h]) - 1
                            assert int(plan.write_pages[l, row, h]) == model[s][l][h][last // block]
                            assert int(plan.write_offsets[l, row, h]) == last % block
        elif model:  # compression: heads shrink to random lengths, tail pages freed
            slot = rng.choice(sorted(model))
            lens = cache.head_lens[slot].clone()
            new_lens = (lens.float() * torch.rand(lens.shape, generator=torch.Generator().manual_seed(rng.randint(0, 1 << 30)))).long().clamp(min=1)
            new_lens = torch.minimum(new_lens, lens)
            num_pages = int(pages_for(lens, block).max())
            tables = cache.page_tables_of(torch.tensor([slot]), num_pages)
            freed = cache.free_tail_pages(torch.tensor([slot]), tables, new_lens.unsqueeze(0))
            dropped = 0
            for l in range(layers):
                for h in range(heads):
                    keep = int(pages_for(int(new_lens[l, h]), block))
                    dropped += len(model[slot][l][h]) - keep
                    del model[slot][l][h][keep:]
            assert freed == dropped
        _check(cache, model)
    cache.release(torch.tensor(sorted(model)))
    assert cache.allocator.num_free == cache.num_pages
    assert cache.tables.chunk_allocator.num_used == 0


def test_chunk_count_is_sized_by_the_pool_not_by_the_flags():
    """The second level holds every page the pool has, in full chunks, plus one partial
    chunk per head: never short, whatever the split of pages among heads."""
    layers, heads, block, max_seqs, max_pages = 1, 2, 2, 3, 30
    cache = PerHeadPagedCache(120, layers, heads, block, max_seqs=max_seqs, max_pages_per_head=max_pages)
    chunk_pages = cache.tables.chunk_pages
    # Worst case: every head one page past a chunk boundary.
    slots = [cache.new_sequence() for _ in range(max_seqs)]
    for slot in slots:
        length = (chunk_pages * 4 + 1) * block
        cache.append(torch.tensor([slot]), torch.tensor([length]), torch.arange(length))
    used = cache.tables.chunk_allocator.num_used
    assert used == max_seqs * layers * heads * 5
    assert used <= ChunkedPageTables.num_chunks_for(120, max_seqs * layers * heads, chunk_pages) - 1


def test_two_level_tables_take_a_fraction_of_flat_ones():
    """Llama-3.1-8B shape (32 layers x 8 KV heads, 16-token pages) at 128K context and 1024
    sequences: flat int64 tables were 17 GB; two levels over a 50 GB pool of 8 KiB pages
    stay under 1% of the pool."""
    num_pages = (50 << 30) // (2 * 16 * 128 * 2)
    nbytes = ChunkedPageTables.nbytes_for(num_pages, 1025, 32, 8, 131072 // 16)
    flat = 1025 * 32 * 8 * (131072 // 16) * 8
    assert nbytes < (50 << 30) // 100 < flat // 10
    # and the formula is what the class allocates (small dimensions)
    tables = ChunkedPageTables(123, 7, 3, 2, 9, torch.device("cpu"))
    allocated = (tables.chunk_tables.nbytes + tables.chunks.nbytes + tables.chunk_allocator.free_stack.nbytes
                 + tables.chunk_shares.nbytes)
    assert ChunkedPageTables.nbytes_for(123, 7, 3, 2, 9) == allocated
