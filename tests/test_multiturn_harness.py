"""``benchmarks/quality/multiturn_eviction_harness.py``'s scorings against direct computations
(its attention and masking are ``ppl_eviction_ceiling.py``'s, tested there)."""

from __future__ import annotations

import math

import torch

from conftest import load_benchmark


def test_prompt_surprisal_is_the_log_softmax_of_the_next_token():
    harness = load_benchmark("multiturn_eviction_harness")
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 11, generator=generator)
    ids = [3, 1, 4, 1, 5, 9]
    got = harness.prompt_surprisal(logits, ids)
    assert got[0] == 0
    for t in range(1, 6):
        want = -math.log(math.exp(logits[t - 1, ids[t]]) / sum(math.exp(v) for v in logits[t - 1].tolist()))
        assert math.isclose(float(got[t]), want, rel_tol=1e-9, abs_tol=1e-9)


def test_scorings_keep_sinks_and_score_sentences_alike_in_every_head():
    from kvcompress.ops.surprisal import SentenceEnds

    harness = load_benchmark("multiturn_eviction_harness")
    texts = ["a", "."]
    ids = [0, 0, 0, 0, 0, 1, 0, 0, 1, 0, 0, 0, 0, 1]  # sentences [0, 6), [6, 9), [9, 14)
    nats = torch.tensor([0, 1, 2, 3, 4, 5, 9, 9, 9, 1, 1, 1, 1, 1], dtype=torch.float64)
    kvc = torch.rand(2, 3, len(ids), dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    got = harness.scorings(kvc, nats, ids, SentenceEnds.from_texts(texts))
    assert set(got) == set(harness.SCORINGS)
    for name in ("surprisal", "surprisal-max", "surprisal-pool31"):
        values = got[name]
        assert values.shape == kvc.shape
        assert torch.isinf(values[..., : harness.SINK_TOKENS]).all()
        assert (values == values[:1, :1]).all()  # every head alike
    mean = got["surprisal"][0, 0]
    # means over known tokens (position 0 has none): (1+2+3+4+5)/5 = 3, 9, 1; over the largest, 9
    assert torch.allclose(mean[harness.SINK_TOKENS :], torch.tensor([3, 3, 9, 9, 9, 1, 1, 1, 1, 1], dtype=torch.float64) / 9)
    assert got["surprisal-max"][0, 0, 4:].tolist() == [5, 5, 9, 9, 9, 1, 1, 1, 1, 1]
    assert got["surprisal-top3"][0, 0, 4:].tolist() == [4, 4, 9, 9, 9, 1, 1, 1, 1, 1]  # (5 + 4 + 3) / 3
    torch.testing.assert_close(got["kvc"], load_benchmark("ppl_eviction_ceiling").max_pool(kvc, 31))
