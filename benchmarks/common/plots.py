"""Plot helpers shared by the benchmark scripts (matplotlib, optional).

Charts are written as 256-colour palette PNGs (:func:`save_figure`): a bar or line chart
has a few dozen colours, so nothing visible changes, and the file is ~40% of matplotlib's
RGBA one. That matters because every call to the lent GPU machine carries the whole
working tree, committed results included, within 64 MiB (``benchmarks/gpu_e2e/kit.py``).
Older charts are shrunk the same way with::

    python -m benchmarks.common.plots benchmarks/results/*.png
"""

from __future__ import annotations

import sys
from pathlib import Path


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def shrink_png(path: str | Path) -> int:
    """Rewrite the PNG at ``path`` as a 256-colour palette PNG, unless it already is one or
    would not get smaller; returns the bytes saved (0 when Pillow is missing)."""
    try:
        from PIL import Image
    except ImportError:
        return 0
    path = Path(path)
    before = path.stat().st_size
    with Image.open(path) as image:
        if image.mode == "P":
            return 0
        palette = image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT,
                                                dither=Image.Dither.NONE)
    shrunk = path.with_name(path.name + ".tmp")
    palette.save(shrunk, format="PNG", optimize=True)
    if shrunk.stat().st_size >= before:
        shrunk.unlink()
        return 0
    shrunk.replace(path)
    return before - path.stat().st_size


def save_figure(figure, path: str | Path, dpi: int = 100) -> None:
    """``figure.savefig(path, dpi=dpi)`` as a palette PNG (:func:`shrink_png`)."""
    figure.savefig(path, dpi=dpi)
    shrink_png(path)


def two_bar_charts(path: str, labels: list[str], left: tuple[list[float], str],
                   right: tuple[list[float], str], title: str, left_ylim: float | None = None) -> str | None:
    """Two bar charts side by side over the same ``labels`` (``(values, y label)``
    each), written to ``path`` (PNG); None when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return None
    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (values, ylabel), color in zip(axes, (left, right), ("tab:blue", "tab:green")):
        ax.bar(labels, values, color=color)
        ax.set_ylabel(ylabel)
        ax.tick_params(axis="x", rotation=30)
    if left_ylim is not None:
        axes[0].set_ylim(0, left_ylim)
    figure.suptitle(title)
    figure.tight_layout()
    save_figure(figure, path)
    plt.close(figure)
    return path


def bar_panels(path: str, labels: list[str], panels: list[tuple[list[float], str]], title: str) -> str | None:
    """One bar chart per ``(values, title)`` panel, side by side over the same
    ``labels``; the first bar (the baseline, stock vLLM) gray. Written to ``path``
    (PNG); None when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return None
    figure, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.8))
    for ax, (values, panel_title) in zip(axes, panels):
        ax.bar(labels, values, color=["tab:gray"] + ["tab:blue"] * (len(values) - 1))
        ax.set_title(panel_title)
    figure.suptitle(title)
    figure.tight_layout()
    save_figure(figure, path)
    plt.close(figure)
    return path


if __name__ == "__main__":
    saved = sum(shrink_png(name) for name in sys.argv[1:])
    print(f"{len(sys.argv) - 1} PNGs, {saved / (1 << 20):.1f} MiB saved")
