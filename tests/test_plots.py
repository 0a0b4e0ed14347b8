"""The benchmark charts' palette PNGs (benchmarks/common/plots.py) against matplotlib's own."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from benchmarks.common import plots

Image = pytest.importorskip("PIL.Image")
plt = plots.pyplot()


@pytest.mark.skipif(plt is None, reason="no matplotlib")
def test_a_chart_saved_as_a_palette_png_is_smaller_and_shows_the_same_pixels(tmp_path):
    figure, ax = plt.subplots(figsize=(6, 4))
    ax.plot([1, 2, 4, 8], [1.0, 1.4, 2.1, 3.3], marker="o", label="kvcompress")
    ax.axhline(1.0, color="gray", linestyle="--", label="stock")
    ax.bar([1, 2], [0.5, 0.7], color=["tab:gray", "tab:blue"])
    ax.legend()
    ax.set_title("throughput vs rate")
    original, saved = tmp_path / "original.png", tmp_path / "saved.png"
    figure.savefig(original, dpi=100)
    plots.save_figure(figure, saved)
    plt.close(figure)

    with Image.open(original) as a, Image.open(saved) as b:
        assert b.mode == "P" and a.size == b.size
        rgb_a = np.asarray(a.convert("RGB"), dtype=np.int16)
        rgb_b = np.asarray(b.convert("RGB"), dtype=np.int16)
    difference = np.abs(rgb_a - rgb_b).max(axis=2)
    assert np.percentile(difference, 99) <= 8  # antialiased edges move a few levels at most
    assert saved.stat().st_size < 0.7 * original.stat().st_size


def test_shrink_png_leaves_a_palette_png_alone(tmp_path):
    path = tmp_path / "p.png"
    Image.new("P", (20, 10)).save(path)
    copy = tmp_path / "copy.png"
    shutil.copy(path, copy)
    assert plots.shrink_png(path) == 0
    assert path.read_bytes() == copy.read_bytes()
