"""benchmarks/throughput/compare_checkouts.py: the run order interleaves the two commits, and
the summary's medians, paired ratios and multipliers over stock match a hand computation."""

from conftest import load_benchmark

compare = load_benchmark("compare_checkouts")


def _run(stock: float, kvc: float) -> dict:
    return {"rows": [{"input_len": 2048, "engine": "stock vLLM", "rate": 1.0, "output_tokens_per_s": stock},
                     {"input_len": 2048, "engine": "kvcompress", "rate": 8.0, "output_tokens_per_s": kvc}]}


def test_run_order_alternates_which_commit_goes_first():
    assert compare.run_order(3) == [(0, "before"), (0, "after"), (1, "after"), (1, "before"),
                                    (2, "before"), (2, "after")]


def test_summary_pairs_runs_by_repetition():
    runs = {"before": [_run(100, 150), _run(80, 120), _run(90, 144)],
            "after": [_run(110, 154), _run(100, 126), _run(90, 126)]}
    summary = {(e["engine"], e["rate"]): e for e in compare.summarize(runs)}
    kvc = summary[("kvcompress", 8.0)]
    assert kvc["before_median"] == 144 and kvc["after_median"] == 126
    # paired ratios 154/150, 126/120, 126/144 -> median 1.0267
    assert abs(kvc["paired_after_over_before"] - 154 / 150) < 1e-12
    # per run kvc/stock: before 1.5, 1.5, 1.6 -> 1.5; after 1.4, 1.26, 1.4 -> 1.4
    assert abs(kvc["before_vs_stock"] - 1.5) < 1e-12 and abs(kvc["after_vs_stock"] - 1.4) < 1e-12
    stock = summary[("stock vLLM", 1.0)]
    assert "before_vs_stock" not in stock and stock["before_median"] == 90
    text = compare.render_markdown([], compare.summarize(runs),
                                   {"date": "d", "machine": "m", "repeats": 3, "benchmark_args": []})
    assert "| 2048 | kvcompress | 8 | 144.0 | 126.0 | 1.027 | 1.500 | 1.400 |" in text
