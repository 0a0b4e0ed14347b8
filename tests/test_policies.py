"""Eviction policies against brute-force implementations of each paper's rule.

For every policy, random metrics over uncompressed heads (every head of a sequence
holds positions 0..n-1, as right after prefill) go through the batched block
schedule; a plain-Python reference computes the paper's per-(layer, head) budget
(uniform, PyramidKV's arithmetic schedule, Ada-KV's top-k with the alpha floor, XKV's
greedy wait-list Algorithm 1, StreamingLLM's sinks + recent window, ...), rounds it to
pages one page at a time (the documented rule), and keeps each head's top-metric KVs.
Keep counts and kept positions must agree exactly. No vLLM needed.
"""

from __future__ import annotations

import heapq
import json
import math

import pytest
import torch

from kvcompress.budget import RequestFieldError, request_budget
from kvcompress.config import KVCompressConfig, KVCompressConfigError
from kvcompress.ops.eviction import protected_slots, schedule_evictions
from kvcompress.ops.metrics import pool_metrics
from kvcompress.ops.policy_scores import policy_metrics
from kvcompress.policies import (
    POLICY_NAMES,
    AdaSplit,
    PyramidSplit,
    UniformSplit,
    XKVSplit,
    load_layer_profile,
    resolve_policy,
)

# --------------------------------------------------------------------------- reference


def _pyramid(per_head: float, num_layers: int, beta: float) -> list[float]:
    """PyramidKV: k_{L-1} = B/beta, k_0 = 2B - B/beta, arithmetic in between."""
    if num_layers == 1:
        return [per_head]
    low = per_head / beta
    high = 2 * per_head - low
    step = (high - low) / (num_layers - 1)
    return [high - layer * step for layer in range(num_layers)]


def _xkv_greedy(scores: list[list[float]], steps: int) -> list[int]:
    """XKV Algorithm 1, literally: a wait list holding each layer's next-largest
    normalised score; each step gives one slot to the layer at the top of the list."""
    normalised = []
    for layer_scores in scores:
        total = sum(layer_scores)
        normalised.append(sorted((v / total if total > 0 else 0.0 for v in layer_scores), reverse=True))
    allocated = [0] * len(scores)
    wait = [(-values[0], layer) for layer, values in enumerate(normalised) if values]
    heapq.heapify(wait)
    for _ in range(steps):
        if not wait:
            break
        _, layer = heapq.heappop(wait)
        allocated[layer] += 1
        if allocated[layer] < len(normalised[layer]):
            heapq.heappush(wait, (-normalised[layer][allocated[layer]], layer))
    return allocated


def reference_keep(policy, metrics, n, window, sinks, wanted, block_size):
    """The paper's rule for one sequence: ``metrics[l][h][i]`` of position i.

    Returns ``(new_lens[l][h], kept[l][h] = set of kept positions)``.
    """
    num_layers, num_heads = len(metrics), len(metrics[0])
    protected = set(range(min(sinks, n))) | set(range(max(0, n - window), n))
    p = len(protected)
    pages = math.ceil(n / block_size)
    evictable = max(0, (pages * block_size - p) // block_size)
    take = min(wanted, evictable * num_layers * num_heads)
    kept_slots = (num_layers * num_heads * pages - take) * block_size
    free = max(kept_slots - num_layers * num_heads * p, 0)
    per_head = free / (num_layers * num_heads)
    split = policy.split
    candidates = [i for i in range(n) if i not in protected]

    def layer_bases(layers):
        """Per-head budget of each layer under a uniform or pyramid layer split."""
        if isinstance(layers, PyramidSplit):
            return _pyramid(per_head, num_layers, layers.beta)
        assert isinstance(layers, UniformSplit), layers
        return [per_head] * num_layers

    if isinstance(split, (UniformSplit, PyramidSplit)):
        targets = [[p + k] * num_heads for k in layer_bases(split)]
    elif isinstance(split, AdaSplit):
        targets = []
        for layer, base in enumerate(layer_bases(split.layers)):
            count = round(base * num_heads)
            ranked = sorted(
                ((-metrics[layer][h][i], h, i) for h in range(num_heads) for i in candidates)
            )[:count]
            wins = [sum(1 for _, h, _ in ranked if h == head) for head in range(num_heads)]
            alpha = split.floor
            targets.append([p + ((1 - alpha) * wins[h] + alpha * base) for h in range(num_heads)])
    elif isinstance(split, XKVSplit):
        if split.layer_profile is not None:
            layer_tokens = [free * share for share in split.layer_profile]
        else:
            scores = [[metrics[l][h][i] for h in range(num_heads) for i in candidates] for l in range(num_layers)]
            layer_tokens = _xkv_greedy(scores, round(free))
        targets = [[p + tokens / num_heads] * num_heads for tokens in layer_tokens]
    else:
        raise AssertionError(split)

    # Rounding rule: one page at a time from the head most above its target.
    evicted = [[0] * num_heads for _ in range(num_layers)]
    for _ in range(take):
        best = None
        for layer in range(num_layers):
            for head in range(num_heads):
                if evicted[layer][head] >= evictable:
                    continue
                excess = (pages - evicted[layer][head]) * block_size - targets[layer][head]
                if best is None or excess > best[0]:
                    best = (excess, layer, head)
        evicted[best[1]][best[2]] += 1
    new_lens, kept = [], []
    for layer in range(num_layers):
        lens_row, kept_row = [], []
        for head in range(num_heads):
            e = evicted[layer][head]
            new_len = n if e == 0 else (pages - e) * block_size
            order = sorted(candidates, key=lambda i: (-metrics[layer][head][i], i))
            lens_row.append(new_len)
            kept_row.append(protected | set(order[: new_len - p]))
        new_lens.append(lens_row)
        kept.append(kept_row)
    return new_lens, kept


# --------------------------------------------------------------------------- cases


def _case(seed: int, num_layers=4, num_heads=3, block_size=4):
    generator = torch.Generator().manual_seed(seed)
    num_seqs = 3
    lengths = torch.randint(20, 90, (num_seqs,), generator=generator)
    num_slots = math.ceil(int(lengths.max()) / block_size) * block_size
    metrics = torch.rand(num_seqs, num_layers, num_heads, num_slots, generator=generator, dtype=torch.float64)
    positions = torch.arange(num_slots).expand(num_seqs, num_layers, num_heads, num_slots).to(torch.int32)
    head_lens = lengths.view(-1, 1, 1).expand(num_seqs, num_layers, num_heads).clone()
    window = torch.randint(0, 12, (num_seqs,), generator=generator)
    sinks = torch.randint(0, 5, (num_seqs,), generator=generator)
    pages = (lengths + block_size - 1) // block_size
    wanted = (torch.rand(num_seqs, generator=generator) * 1.1 * pages * num_layers * num_heads).long()
    return metrics, positions, head_lens, lengths, window, sinks, wanted, block_size


def _check(policy, seed, **shape):
    metrics, positions, head_lens, lengths, window, sinks, wanted, block_size = _case(seed, **shape)
    generator = torch.Generator().manual_seed(seed + 1000)
    ranked = policy_metrics(policy, metrics, positions, generator).to(torch.float64)
    protected = protected_slots(positions, head_lens, lengths, window, sinks)
    plan = schedule_evictions(ranked, head_lens, protected, wanted, block_size, split=policy.split)
    num_layers, num_heads = metrics.shape[1], metrics.shape[2]
    for s in range(metrics.shape[0]):
        n = int(lengths[s])
        values = ranked[s, :, :, :n].tolist()
        new_lens, kept = reference_keep(
            policy, values, n, int(window[s]), int(sinks[s]), int(wanted[s]), block_size
        )
        assert plan.new_head_lens[s].tolist() == new_lens, (policy.name, seed, s)
        for layer in range(num_layers):
            for head in range(num_heads):
                got = set(torch.nonzero(~plan.evicted[s, layer, head, :n]).flatten().tolist())
                assert got == kept[layer][head], (policy.name, seed, s, layer, head)


@pytest.mark.parametrize("name", [n for n in POLICY_NAMES if not resolve_policy(n).split.is_global])
@pytest.mark.parametrize("seed", range(12))
def test_policy_matches_brute_force_reference(name, seed):
    _check(resolve_policy(name), seed)


@pytest.mark.parametrize("seed", range(6))
def test_policy_knobs_match_reference(seed):
    """Non-default beta / alpha, a one-layer model, and a saved XKV profile."""
    _check(resolve_policy("pyramidkv", pyramid_beta=3.0), seed)
    _check(resolve_policy("ada-pyramidkv", pyramid_beta=5.0, ada_floor=0.2), seed)
    _check(resolve_policy("ada-snapkv", ada_floor=1.0), seed)
    _check(resolve_policy("ada-snapkv", ada_floor=0.0), seed, num_layers=1, num_heads=4)
    _check(resolve_policy("xkv", layer_profile=(0.4, 0.3, 0.2, 0.1)), seed)


def test_ada_floor_one_is_uniform_and_pyramid_beta_one_is_uniform():
    for seed in range(4):
        metrics, positions, head_lens, lengths, window, sinks, wanted, b = _case(seed)
        protected = protected_slots(positions, head_lens, lengths, window, sinks)
        uniform = schedule_evictions(metrics, head_lens, protected, wanted, b, split=resolve_policy("snapkv").split)
        for other in (resolve_policy("ada-snapkv", ada_floor=1.0), resolve_policy("pyramidkv", pyramid_beta=1.0)):
            plan = schedule_evictions(metrics, head_lens, protected, wanted, b, split=other.split)
            assert torch.equal(plan.new_head_lens, uniform.new_head_lens)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_frees_exactly_what_is_asked_on_ragged_heads(name):
    """After earlier compressions heads are ragged: still exactly min(E, evictable)
    pages, no protected KV evicted, each head loses a prefix of its cheapest KVs."""
    policy = resolve_policy(name)
    generator = torch.Generator().manual_seed(7)
    num_seqs, num_layers, num_heads, b = 4, 3, 2, 4
    head_lens = torch.randint(1, 60, (num_seqs, num_layers, num_heads), generator=generator)
    num_slots = math.ceil(int(head_lens.max()) / b) * b
    metrics = torch.rand(num_seqs, num_layers, num_heads, num_slots, generator=generator)
    positions = torch.stack([torch.randperm(80, generator=generator)[:num_slots] for _ in range(num_seqs * num_layers * num_heads)])
    positions = positions.view(num_seqs, num_layers, num_heads, num_slots).to(torch.int32)
    protected = protected_slots(positions, head_lens, 80, 10, policy.sink_tokens)
    held = torch.arange(num_slots) < head_lens.unsqueeze(-1)
    padded = (head_lens + b - 1) // b * b
    evictable = ((padded - (protected & held).sum(-1)) // b).clamp(min=0).sum(dim=(1, 2))
    wanted = torch.tensor([0, 3, int(evictable[2]) // 2, 10_000])
    ranked = policy_metrics(policy, metrics, positions, torch.Generator().manual_seed(1))
    plan = schedule_evictions(ranked, head_lens, protected, wanted, b, split=policy.split)
    assert plan.evict_blocks.sum(dim=(1, 2)).tolist() == torch.minimum(wanted, evictable).tolist()
    assert not (plan.evicted & protected).any()
    assert ((head_lens - plan.new_head_lens) == plan.evicted.sum(-1)).all()


def test_streamingllm_keeps_sinks_and_the_most_recent():
    policy = resolve_policy("streamingllm")
    n, b = 64, 16
    positions = torch.arange(n).view(1, 1, 1, n).to(torch.int32)
    head_lens = torch.full((1, 1, 1), n)
    protected = protected_slots(positions, head_lens, n, 8, policy.sink_tokens)
    ranked = policy_metrics(policy, torch.rand(1, 1, 1, n), positions)
    plan = schedule_evictions(ranked, head_lens, protected, torch.tensor([2]), b, split=policy.split)
    kept = torch.nonzero(~plan.evicted[0, 0, 0]).flatten().tolist()
    assert kept == [0, 1, 2, 3] + list(range(n - 28, n))


def test_avg_pool_matches_brute_force():
    from kvcompress.ops.paged_cache import PerHeadPagedCache

    cache = PerHeadPagedCache(num_pages=64, num_layers=1, num_kv_heads=2, block_size=4, max_seqs=2, max_pages_per_head=16)
    seq = cache.new_sequence()
    n = 23
    cache.append(torch.tensor([seq]), torch.tensor([n]), torch.arange(n))
    tables = cache.flat_page_tables()[seq, 0, :, :6]
    lens = cache.head_lens[seq, 0]
    values = torch.rand(2, 24, dtype=torch.float32)
    slots = (tables.unsqueeze(-1) * 4 + torch.arange(4)).reshape(2, -1)
    cache.slot_metrics.view(-1)[slots] = values
    pool_metrics(cache.slot_metrics, tables, lens, 5, "avg")
    pooled = cache.slot_metrics.view(-1)[slots]
    for head in range(2):
        for i in range(n):
            window = [float(values[head, j]) for j in range(max(0, i - 2), min(n, i + 3))]
            assert pooled[head, i].item() == pytest.approx(sum(window) / len(window), rel=1e-6)


def test_policy_settings_and_errors(tmp_path):
    settings = KVCompressConfig(enabled=True, rate=4, policy="snapkv")
    assert settings.policy_for().metric.observation_window == 32
    assert settings.policy_for().metric.power == 1
    assert settings.policy_for("kvc").metric.power == 2
    assert settings.policy_for("streamingllm").sink_tokens == 4
    assert KVCompressConfig(enabled=True, sink_tokens=2).policy_for("streamingllm").sink_tokens == 2
    assert KVCompressConfig(enabled=True, metric="l1").policy_for("kvc").metric.power == 1
    assert request_budget(settings, {"kv_compress_policy": "H2O"}).policy == "h2o"
    assert request_budget(settings, {"kv_compress_policy": "streamingllm"}).sink_tokens == 4
    assert request_budget(settings, None).policy == "snapkv"
    assert request_budget(settings, {"kv_compress_observation_window": 16}).observation_window == 16
    with pytest.raises(RequestFieldError, match="kv_compress_observation_window"):
        request_budget(settings, {"kv_compress_observation_window": 0})
    with pytest.raises(RequestFieldError, match="kv_compress_policy"):
        request_budget(settings, {"kv_compress_policy": "pyramidinfer"})
    with pytest.raises(KVCompressConfigError, match="--kv-compress-policy"):
        KVCompressConfig.from_dict({"enabled": True, "policy": "pyramidinfer"})
    with pytest.raises(KVCompressConfigError, match="--kv-compress-ada-floor"):
        KVCompressConfig.from_dict({"enabled": True, "ada_floor": 1.5})
    with pytest.raises(KVCompressConfigError, match="--kv-compress-pyramid-beta"):
        KVCompressConfig.from_dict({"enabled": True, "pyramid_beta": 0.5})
    with pytest.raises(KVCompressConfigError, match="--kv-compress-xkv-profile.*missing.json"):
        KVCompressConfig.from_dict({"enabled": True, "xkv_profile": str(tmp_path / "missing.json")})
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"layer_shares": [1, -1]}))
    with pytest.raises(KVCompressConfigError, match="layer 1"):
        KVCompressConfig.from_dict({"enabled": True, "xkv_profile": str(bad)})
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"layer_shares": [3, 1]}))
    assert load_layer_profile(good) == (0.75, 0.25)
    config = KVCompressConfig(enabled=True, policy="xkv", xkv_profile=str(good))
    assert config.policy_for().split.layer_profile == (0.75, 0.25)
    assert config.policy_for("snapkv").split.layer_profile is None


def test_registry_declares_each_policy_once_with_its_rules():
    """POLICY_NAMES comes from the registry, in order; every policy's metric source
    and budget split have a torch rule; resolved policies pickle (scheduler -> worker)."""
    import pickle

    from kvcompress.ops.budget_split import SPLIT_RULES
    from kvcompress.ops.policy_scores import RANKERS
    from kvcompress.policies import POLICIES

    assert POLICY_NAMES == (
        "kvc", "kvc-ea", "kvc-paper", "kvc-full", "kvzip", "surprisal", "snapkv", "pyramidkv", "ada-snapkv", "ada-pyramidkv", "xkv", "h2o",
        "streamingllm", "random",
    )
    assert tuple(POLICIES) == POLICY_NAMES
    for name, definition in POLICIES.items():
        policy = resolve_policy(name)
        assert policy.name == name and type(policy.metric.source) in RANKERS
        split = policy.split
        while split is not None and not split.is_global:
            assert type(split) in SPLIT_RULES, (name, split)
            split = getattr(split, "layers", None)
        assert pickle.loads(pickle.dumps(policy)) == policy
        assert hash(policy) == hash(resolve_policy(name))


def test_a_new_policy_is_one_registry_entry(monkeypatch):
    """A policy registered from existing strategies resolves and runs through the
    schedule with no other change (here: a pyramid split with L2 over all queries)."""
    from kvcompress import policies
    from kvcompress.policies import MetricSpec, PolicyDefinition

    monkeypatch.setattr(policies, "POLICIES", dict(policies.POLICIES))
    policies.register_policy(PolicyDefinition(
        "test-pyramid-l2", MetricSpec(power=2, queries="full", skip_nearest=0), PyramidSplit(beta=4.0),
        sink_tokens=2,
    ))
    with pytest.raises(ValueError, match="already registered"):
        policies.register_policy(policies.POLICIES["kvc"])
    policy = resolve_policy("test-pyramid-l2", pyramid_beta=3.0)
    assert (policy.metric.power, policy.metric.queries, policy.sink_tokens) == (2, "full", 2)
    assert policy.split == PyramidSplit(beta=3.0)
    assert "test-pyramid-l2" in policies.policies_using("pyramid_beta")
    for seed in range(3):
        _check(policy, seed)
