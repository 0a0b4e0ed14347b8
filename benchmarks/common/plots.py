"""Plot helpers shared by the benchmark scripts (matplotlib, optional)."""

from __future__ import annotations


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


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
    figure.savefig(path, dpi=100)
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
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
