"""PNG plots for the bench suites (matplotlib, Agg backend: no display needed). Driver thread
only. Each function writes one file and returns its name (relative to the output dir).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path


def _pyplot():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def line_plot(
    path: Path,
    xs: Sequence[float],
    series: Mapping[str, Sequence[float]],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    logx: bool = False,
    logy: bool = False,
) -> str:
    """One line per series over the shared xs."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, ys in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    if logx:
        ax.set_xscale("log", base=2)
    return _labelled(plt, fig, ax, path, title, xlabel, ylabel, logy)


def xy_plot(
    path: Path,
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    logy: bool = False,
) -> str:
    """One line per series, each over its own xs: {label: (xs, ys)}."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, label=label)
    return _labelled(plt, fig, ax, path, title, xlabel, ylabel, logy)


def bar_plot(
    path: Path,
    labels: Sequence[str],
    groups: Mapping[str, Sequence[float]],
    *,
    title: str,
    ylabel: str,
    logy: bool = False,
) -> str:
    """Grouped bars: one group per label, one bar per series."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.0, 4.0))
    width = 0.8 / max(1, len(groups))
    for i, (name, values) in enumerate(groups.items()):
        ax.bar([x + i * width for x in range(len(labels))], values, width, label=name)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))], labels, rotation=20, ha="right", fontsize=8)
    if logy:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.grid(True, axis="y", alpha=0.3)
    return _save(plt, fig, ax, path)


def _labelled(plt, fig, ax, path: Path, title: str, xlabel: str, ylabel: str, logy: bool) -> str:
    """Log y axis if asked, title, axis labels, grid; then `_save`."""
    if logy:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return _save(plt, fig, ax, path)


def _save(plt, fig, ax, path: Path) -> str:  # type: ignore[no-untyped-def]
    """Legend, layout, write the PNG, free the figure; returns the file name."""
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path.name
