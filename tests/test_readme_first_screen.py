"""The README's first screen is the quick start (issue 19): the demo and test commands,
the serve one-liner, and the demo's table exactly as the recorded demo run wrote it."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIRST_SCREEN_LINES = 45


def _first_screen() -> list[str]:
    return (ROOT / "README.md").read_text().splitlines()[:FIRST_SCREEN_LINES]


def test_quick_start_commands_come_first():
    screen = "\n".join(_first_screen())
    for command in ("make demo", "make test", "make serve", "vllm serve MODEL --kv-compress-rate 8"):
        assert command in screen, command
    makefile = (ROOT / "Makefile").read_text()
    assert "demo: setup\n\t$(PY) benchmarks/serving/demo.py" in makefile


def test_demo_table_is_the_recorded_runs():
    recorded = (ROOT / "benchmarks/results/demo-smollm2-cpu.md").read_text().splitlines()
    table = [line for line in recorded if line.startswith("| ") and "MiB" in line]
    assert len(table) == 4  # stock and rates 1, 4, 8
    screen = _first_screen()
    for row in table:
        assert row in screen, row
