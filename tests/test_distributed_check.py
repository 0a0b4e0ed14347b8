"""`vllm serve` past one device (benchmarks/serving/distributed_check.py): TP=2 on one node and on
two "nodes" on 127.0.0.1 (vLLM's multi-node mp launch), TP=2 on vLLM's Ray executor,
DP=2. Minutes of server starts,
so not in the default run: ``pytest -m slow tests``."""

from __future__ import annotations

import pytest
from conftest import load_benchmark

@pytest.mark.engine
@pytest.mark.slow
def test_every_layout_answers_compresses_and_frees_every_page(tmp_path):
    check = load_benchmark("distributed_check")
    assert check.main(["--log-dir", str(tmp_path), "--requests", "8", "--max-tokens", "32"]) == 0


def test_the_checks_catch_what_they_claim():
    """The checker itself against hand-made results: each broken field is reported."""
    check = load_benchmark("distributed_check")
    requests = [{"max_tokens": 2}] * 2
    good = {"layout": "tp2", "tokens": [[1, 2], [3, 4]], "tokens_rate_one": [[5, 6], [7, 8]],
            "engines_compressing": 1, "page_mismatches": 0.0, "pages_total": 10.0, "pages_free": 10.0}
    stock = {"layout": "stock-tp2", "tokens_rate_one": [[5, 6], [7, 8]]}
    engines = check.ENGINES
    assert check.check([good, {**good, "layout": "tp2-two-nodes"}], requests, engines) == []
    broken = [
        {**good, "tokens": [[1], [3, 4]]},
        {**good, "engines_compressing": 0},
        {**good, "page_mismatches": 1.0},
        {**good, "pages_free": 9.0},
    ]
    for result in broken:
        assert len(check.check([result], requests, engines)) == 1, result
    for name in ("tp2-two-nodes", "tp2-ray"):
        other = {**good, "layout": name, "tokens": [[1, 2], [3, 5]]}
        assert check.check([good, other], requests, engines) == [f"tp2 and {name} gave different tokens"]
    assert check.check([{**good, "layout": "dp2"}], requests, engines) == ["dp2: 1 of 2 engines compressed"]
    assert check.check([stock, good], requests, engines) == []
    drifted = {**good, "tokens_rate_one": [[5, 6], [7, 9]]}
    assert check.check([stock, drifted], requests, engines) == [
        "tp2: tokens at rate 1 differ from stock vLLM's at TP=2"
    ]
