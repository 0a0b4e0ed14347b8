"""kvcompress.ops.expected_attention against independent constructions: the moved
queries' Gaussian against explicit D x D rotation matrices (un-rotate, then average the
rotations to the coming positions), the closed form against sampling, the frequencies
read back from a RoPE table, and the ranking against a per-head brute force."""

from __future__ import annotations

import math

import pytest
import torch

from kvcompress.ops.expected_attention import (
    expected_attention,
    future_gaussian,
    rank_within_heads,
    rope_frequencies,
)


def rotation_matrix(position: float, inv_freq: torch.Tensor, head_dim: int, neox: bool) -> torch.Tensor:
    """RoPE at ``position`` as a ``[D, D]`` float64 matrix, built from its definition."""
    rotary_dim = 2 * inv_freq.shape[0]
    matrix = torch.eye(head_dim, dtype=torch.float64)
    for i, freq in enumerate(inv_freq.tolist()):
        a, b = (i, i + rotary_dim // 2) if neox else (2 * i, 2 * i + 1)
        c, s = math.cos(position * freq), math.sin(position * freq)
        matrix[a, a], matrix[a, b], matrix[b, a], matrix[b, b] = c, -s, s, c
    return matrix


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("rotary_dim", [16, 12], ids=["full", "partial"])
def test_moved_queries_equal_unrotate_then_average(neox, rotary_dim):
    gen = torch.Generator().manual_seed(3)
    head_dim, heads, window, start, horizon = 16, 3, 9, 40, 7
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    positions = torch.arange(start - window, start)
    raw = torch.randn(window, heads, head_dim, generator=gen, dtype=torch.float64)
    rotated = torch.stack([raw[i] @ rotation_matrix(float(p), inv_freq, head_dim, neox).T
                           for i, p in enumerate(positions.tolist())])
    mean, cov = future_gaussian(rotated, positions, inv_freq, neox, start, horizon)
    # oracle: un-rotated queries' Gaussian, moved by the mean rotation over the horizon
    average = sum(rotation_matrix(float(p), inv_freq, head_dim, neox) for p in range(start, start + horizon)) / horizon
    raw_mean = raw.mean(0)
    centred = raw - raw_mean
    raw_cov = torch.einsum("whd,whe->hde", centred, centred) / (window - 1)
    assert torch.allclose(mean, raw_mean @ average.T, atol=1e-10)
    assert torch.allclose(cov, average @ raw_cov @ average.T, atol=1e-10)


def test_closed_form_equals_sampled_queries():
    gen = torch.Generator().manual_seed(5)
    heads, group, keys_per_head, head_dim, scale = 2, 2, 6, 8, 0.3
    mean = torch.randn(heads * group, head_dim, generator=gen, dtype=torch.float64) * 0.5
    factor = torch.randn(heads * group, head_dim, head_dim, generator=gen, dtype=torch.float64) * 0.3
    cov = factor @ factor.transpose(1, 2)
    keys = torch.randn(heads, keys_per_head, head_dim, generator=gen, dtype=torch.float64)
    lens = torch.tensor([6, 4])
    got = expected_attention(mean, cov, keys, lens, scale)
    samples = 400_000
    want = torch.zeros(heads, keys_per_head, dtype=torch.float64)
    for q_head in range(heads * group):
        head = q_head // group
        draws = mean[q_head] + torch.randn(samples, head_dim, generator=gen, dtype=torch.float64) @ torch.linalg.cholesky(
            cov[q_head] + 1e-12 * torch.eye(head_dim, dtype=torch.float64)).T
        weights = torch.exp(scale * draws @ keys[head, : lens[head]].T).mean(0)  # E[exp(s q.k)] per key
        want[head, : lens[head]] += weights / weights.sum()
    assert torch.allclose(got, want, atol=2e-2), (got, want)
    assert torch.all(got[1, 4:] == 0)
    assert torch.allclose(got.sum(-1), torch.full((heads,), float(group), dtype=torch.float64))


def test_frequencies_read_back_from_a_rope_table():
    rotary_dim = 64
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    inv_freq[:4] /= 8.0  # a scaled band, as long-context RoPE variants make
    freqs = torch.arange(32, dtype=torch.float32)[:, None] * inv_freq[None, :]
    table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # vLLM's cos_sin_cache rows
    assert torch.allclose(rope_frequencies(table, rotary_dim), inv_freq.double(), rtol=1e-5, atol=1e-7)


def test_ranking_keeps_each_heads_values_in_the_combined_order():
    gen = torch.Generator().manual_seed(7)
    heads, length = 4, 23
    kvc = torch.rand(heads, length, generator=gen)
    expected = torch.rand(heads, length, generator=gen, dtype=torch.float64)
    lens = torch.tensor([23, 17, 1, 9])
    got = rank_within_heads(kvc, expected, lens)
    for head in range(heads):
        n = int(lens[head])
        values, weights = kvc[head, :n].double(), expected[head, :n]
        combined = values / values.sum() + weights / weights.sum()
        # brute force: the i-th smallest combined score's slot holds the i-th smallest value
        for rank, slot in enumerate(combined.argsort().tolist()):
            assert got[head, slot] == values.sort().values[rank].float()
        assert torch.equal(got[head, n:], kvc[head, n:])
    assert got.dtype == kvc.dtype


def test_ranking_with_no_expected_signal_keeps_kvcs_order():
    kvc = torch.tensor([[0.5, 0.1, 0.9, 0.3]])
    got = rank_within_heads(kvc, torch.full((1, 4), 0.25, dtype=torch.float64), torch.tensor([4]))
    assert torch.equal(got, kvc)


def test_prompt_end_ranking_writes_only_the_heads_held_slots():
    from kvcompress.ops.expected_attention import RopeFrequencies, rank_prompt_metrics

    gen = torch.Generator().manual_seed(11)
    num_pages, block, head_dim, heads, group = 12, 4, 8, 2, 2
    key_cache = torch.randn(num_pages, block, head_dim, generator=gen)
    metrics = torch.rand(num_pages, block, generator=gen)
    before = metrics.clone()
    # head 0 holds pages 3, 7 (6 KVs); head 1 pages 5, 2 (8 KVs); column 2 is garbage that
    # points at page 9, another sequence's
    tables = torch.tensor([[3, 7, 9], [5, 2, 9]])
    lens = torch.tensor([6, 8])
    query = torch.randn(5, heads * group, head_dim, generator=gen)
    positions = torch.arange(3, 8)
    rope = RopeFrequencies(1.0 / (100.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)), True)
    rank_prompt_metrics(metrics, key_cache, query, positions, tables, lens, 0.3, rope)
    for head in range(heads):
        held = [(int(tables[head, s // block]), s % block) for s in range(int(lens[head]))]
        old = torch.stack([before[p, o] for p, o in held])
        new = torch.stack([metrics[p, o] for p, o in held])
        assert torch.equal(old.sort().values, new.sort().values)  # the head's multiset
        keys = torch.stack([key_cache[p, o] for p, o in held])  # logical order
        mean, cov = future_gaussian(query, positions, rope.inv_freq, True, 8, 256)
        weights = expected_attention(mean[2 * head : 2 * head + 2], cov[2 * head : 2 * head + 2],
                                     keys[None], lens[head : head + 1], 0.3)
        want = rank_within_heads(old[None], weights, lens[head : head + 1])[0]
        assert torch.equal(new, want)
    untouched = torch.ones_like(metrics, dtype=torch.bool)
    untouched[[3, 7, 5, 2]] = False
    untouched[7, 2:] = True  # head 0's second page holds 2 KVs
    assert torch.equal(metrics[untouched], before[untouched])


def test_prompt_end_ranking_leaves_protected_slots_alone():
    from kvcompress.ops.expected_attention import RopeFrequencies, rank_prompt_metrics

    gen = torch.Generator().manual_seed(13)
    key_cache = torch.randn(6, 4, 8, generator=gen)
    metrics = torch.rand(6, 4, generator=gen)
    before = metrics.clone()
    tables, lens = torch.tensor([[1, 4, 0]]), torch.tensor([11])
    rope = RopeFrequencies(1.0 / (100.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)), False)
    rank_prompt_metrics(metrics, key_cache, torch.randn(4, 2, 8, generator=gen), torch.arange(7, 11),
                        tables, lens, 0.3, rope, sinks=1, protected=3)
    slots = [(int(tables[0, s // 4]), s % 4) for s in range(11)]
    old = torch.stack([before[p, o] for p, o in slots])
    new = torch.stack([metrics[p, o] for p, o in slots])
    assert new[0] == old[0] and torch.equal(new[8:], old[8:])
    assert torch.equal(new[1:8].sort().values, old[1:8].sort().values) and not torch.equal(new[1:8], old[1:8])
    assert torch.equal(metrics[[0, 2, 3, 5]], before[[0, 2, 3, 5]])


def test_prompt_end_ranking_with_the_hosts_start_reads_nothing_on_the_host():
    """Given the window's end position from the host (as the runner gives it), the pass
    makes no torch call that reads a device value on the host (a stream sync at every
    layer on CUDA) and writes what the self-reading call writes, with table columns past
    a head's length pointing at the other head's held pages."""
    from host_reads import HostReadWatch

    from kvcompress.ops.expected_attention import RopeFrequencies, rank_prompt_metrics

    gen = torch.Generator().manual_seed(17)
    key_cache = torch.randn(10, 4, 8, generator=gen)
    metrics = torch.rand(10, 4, generator=gen)
    tables, lens = torch.tensor([[1, 4, 6], [6, 8, 1]]), torch.tensor([7, 5])
    query, positions = torch.randn(3, 4, 8, generator=gen), torch.arange(4, 7)
    rope = RopeFrequencies(1.0 / (100.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)), True)
    want = metrics.clone()
    rank_prompt_metrics(want, key_cache, query, positions, tables, lens, 0.3, rope, sinks=1, protected=2)
    with HostReadWatch() as watch:
        rank_prompt_metrics(metrics, key_cache, query, positions, tables, lens, 0.3, rope, sinks=1, protected=2,
                            start=7)
    assert watch.reads == []
    assert torch.equal(metrics, want)
