#!/usr/bin/env python
"""Compare training runs: a table of every results.json found, and a throughput chart.

    python scripts/compare.py multirun/2026-11-22/10-00-00
    python scripts/compare.py outputs/run_a outputs/run_b --png throughput.png --json rows.json

Each argument is a multirun directory, a job directory or a results.json file; directories are
searched recursively. The table is sorted by samples/s (fastest first), then skipped and failed
runs with their reason. The PNG (default ``compare.png`` in the first directory given) follows the
Chimera paper's Figures 10-11: one panel per pipeline depth D (its title gives the replicas W), throughput per
strategy on one y-scale for all panels, grouped by micro-batch size B (or by a W/B/N label when B alone does not
tell runs apart or they differ in W).

No results.json, or a path that does not exist, exits with status 2 and an ``error: ...`` line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline_recipes.recipe.check.settings import BASELINES
from pipeline_recipes.recipe.report.results import RunResult, find_results, sort_results, summary_table
from pipeline_recipes.strategies.schedules import names

if TYPE_CHECKING:
    from matplotlib.figure import Figure

STRATEGY_ORDER = (*names(), *BASELINES)  # the registry's schedules in their order, then the baselines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="compare.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", metavar="PATH", help="multirun directory, job directory or results.json")
    parser.add_argument("--png", metavar="FILE", help="chart path (default: compare.png in the first directory given)")
    parser.add_argument("--json", metavar="FILE", help="also write the sorted rows as a JSON list")
    return parser


def _slot(result: RunResult, by_b: bool) -> tuple[tuple, str]:
    """(sort key, x label) of the bar group a run belongs to."""
    if by_b:
        return (result.B or 0,), f"{result.B}"
    return (result.B or 0, result.W or 0, result.N or 0), f"W={result.W}\nB={result.B}\nN={result.N}"


def panel_title(depth: int, panel: list[RunResult]) -> str:
    """``D = 4, W = 2``: a panel's depth and the replicas W its runs had; ``W = 1, 2 (under each group)`` where they
    had several (the bar groups are then labelled W/B/N: :func:`_slot`)."""
    widths = sorted({r.W for r in panel if r.W is not None})
    if len(widths) > 1:
        return f"D = {depth}, W = {', '.join(map(str, widths))} (under each group)"
    return f"D = {depth}" + (f", W = {widths[0]}" if widths else "")


def chart(results: list[RunResult]) -> Figure:
    """One panel per D, titled with its W (:func:`panel_title`): bars of samples/s per strategy, one group per B (or
    W/B/N where B alone does not tell the runs apart or they differ in W), on one y-scale shared by every panel.
    Where a strategy has no successful run in a group, its skipped/failed status is written instead. Repeated runs
    of one setting show the fastest. One legend for all panels (a strategy has one colour everywhere), outside the
    panels, so it covers no bar."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # the Agg backend, no display needed
    from matplotlib.figure import Figure

    runs = [r for r in sort_results(results) if r.D is not None and r.strategy]
    depths = sorted({r.D for r in runs})
    strategies = sorted({r.strategy for r in runs},
                        key=lambda s: (STRATEGY_ORDER.index(s) if s in STRATEGY_ORDER else len(STRATEGY_ORDER), s))
    colors = {s: f"C{i}" for i, s in enumerate(strategies)}  # one color per strategy in every panel

    fig = Figure(figsize=(max(4.5 * len(depths), 6.0) + 1.5, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    # one throughput scale for every panel, so bars compare across D as within a panel
    axes = fig.subplots(1, max(len(depths), 1), squeeze=False, sharey=True)[0]
    if not depths:
        axes[0].text(0.5, 0.5, "no runs with a layout", ha="center", va="center", transform=axes[0].transAxes)
    for ax, depth in zip(axes, depths):
        panel = [r for r in runs if r.D == depth]
        by_b = (len({(r.strategy, r.B) for r in panel}) == len({(r.strategy, r.B, r.W, r.N) for r in panel})
                and len({r.W for r in panel}) == 1)  # else the groups say their W
        slots = sorted({_slot(r, by_b) for r in panel})
        present = [s for s in strategies if any(r.strategy == s for r in panel)]
        width = 0.8 / len(present)
        for i, strategy in enumerate(present):
            label = strategy  # on the first bar only
            for x, slot in enumerate(slots):
                cell = [r for r in panel if r.strategy == strategy and _slot(r, by_b) == slot]
                if not cell:
                    continue
                xpos = x - 0.4 + width * (i + 0.5)
                best = cell[0]  # sorted: the fastest ok run first
                if best.ok and best.samples_per_s is not None:
                    ax.bar(xpos, best.samples_per_s, width, color=colors[strategy], label=label)
                    label = None
                else:
                    ax.text(xpos, 0, f" {best.status}", rotation=90, ha="center", va="bottom", fontsize=7,
                            color=colors[strategy])
        ax.set_xticks(range(len(slots)), [label for _, label in slots])
        ax.set_xlim(-0.5, len(slots) - 0.5)
        ax.set_xlabel("micro-batch size B" if by_b else "layout")
        ax.set_title(panel_title(depth, panel))
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("throughput (samples/s)")
    handles: dict[str, Any] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    if handles:
        ordered = [s for s in strategies if s in handles]
        fig.legend([handles[s] for s in ordered], ordered, loc="outside right upper", fontsize=8)
    return fig


def save_chart(results: list[RunResult], path: Path) -> None:
    """:func:`chart` as a PNG at ``path``."""
    chart(results).savefig(path, dpi=120)


def default_png(first: Path) -> Path:
    return (first if first.is_dir() else first.parent) / "compare.png"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        results = find_results(args.paths)
        if not results:
            raise ValueError(f"no results.json found under {', '.join(args.paths)}")
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(summary_table(results))
    png = Path(args.png) if args.png else default_png(Path(args.paths[0]))
    try:
        save_chart(results, png)
        print(f"wrote {png}")
        if args.json:
            rows = [r.to_dict() for r in sort_results(results)]
            Path(args.json).write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
            print(f"wrote {args.json}")
    except OSError as exc:
        print(f"error: cannot write {exc.filename or png}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
