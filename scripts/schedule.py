#!/usr/bin/env python
"""Show a pipeline schedule: ASCII timeline (default), PNG picture or JSON data.

    python scripts/schedule.py chimera --stages 4 --micro-batches 4
    python scripts/schedule.py dapple --stages 4 --micro-batches 8 --t-f 1 --t-b 1
    python scripts/schedule.py chimera --stages 8 --micro-batches 16 --pipelines 4 --png chimera.png
    python scripts/schedule.py gpipe --stages 4 --micro-batches 4 --json
    python scripts/schedule.py gems --stages 4 --micro-batches 4
    python scripts/schedule.py chimera --stages 4 --micro-batches 16 --concat auto
    python scripts/schedule.py pipedream_2bw --stages 4 --micro-batches 4 --steps 3   (asynchronous: no flushes)
    python scripts/schedule.py interleaved_1f1b --workers 4 --chunks 2 --micro-batches 8
    python scripts/schedule.py zbv --workers 4 --micro-batches 8 --json   (kinds F, B, I, W; "overlap" pairs)

``--workers P`` sets the pipeline's workers; ``--stages D`` is accepted for schedules with one stage per
worker (then P = D). A schedule with ``v`` chunks per worker has S = v·P stages.

Invalid settings exit with status 2 and an ``error: ...`` line naming the setting and a fix.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace

from pipeline_recipes.strategies.schedules import (
    AUTO_CONCAT, CLI, CONCAT_METHODS, build_schedule, get_spec, names, simulate, specs, validate,
)
from pipeline_recipes.strategies.schedules.registry import ASYNC_VIEW_STEPS
from pipeline_recipes.strategies.schedules.render import ascii_timeline, save_png


def build_parser() -> argparse.ArgumentParser:
    """The viewer's arguments; the schedule choices are the registry's
    (:mod:`pipeline_recipes.strategies.schedules.registry`)."""
    parser = argparse.ArgumentParser(
        prog="schedule.py",
        description="Build a pipeline schedule, simulate it and show its timeline (Chimera paper, Figures 2-3).",
        epilog="Times and costs are in arbitrary units; only the ratio t_b / t_f shapes the timeline.",
    )
    parser.add_argument("schedule", choices=names(), help="schedule to build")
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--workers", type=int, metavar="P", help="workers of one pipeline (P; S = v·P stages)")
    size.add_argument("--stages", type=int, metavar="D",
                      help="pipeline stages = workers (D), for schedules with one stage per worker")
    parser.add_argument("--micro-batches", type=int, required=True, metavar="N", help="micro-batches per iteration (N)")
    def only(predicate) -> str:
        return ", ".join(sp.name for sp in specs() if predicate(sp)) or "none"

    parser.add_argument(
        "--pipelines", type=int, metavar="P",
        help="number of pipelines, for " + "; ".join(f"{sp.name}: {sp.pipelines.rule} (default {sp.pipelines.default})"
                                                     for sp in specs() if sp.pipelines.choices is not None),
    )
    parser.add_argument(
        "--concat", choices=(*CONCAT_METHODS, AUTO_CONCAT),
        help=f"{only(lambda sp: sp.concat)} only: how units of D micro-batches are concatenated when N > D (default "
             "direct); auto: the fastest at t_b = 2 t_f, as strategy.concat=auto picks it for an even micro-batch size",
    )
    parser.add_argument(
        "--chunks", type=int, metavar="V",
        help=f"stages per worker (v), for {only(lambda sp: sp.chunks.choosable)}; the others run their fixed number "
             "(one for a schedule without chunks)",
    )
    parser.add_argument(
        "--steps", type=int, metavar="T",
        help=f"asynchronous schedules only ({only(lambda sp: sp.asynchronous)}): optimizer steps shown back to "
             f"back, then the drain (default {ASYNC_VIEW_STEPS})",
    )
    parser.add_argument(
        "--t-f", type=float, default=1.0, metavar="T",
        help="simulated cost of one stage's forward of one micro-batch (default 1.0)",
    )
    parser.add_argument(
        "--t-b", type=float, default=2.0, metavar="T",
        help="simulated cost of one stage's backward of one micro-batch (default 2.0, i.e. twice the forward)",
    )
    parser.add_argument(
        "--t-w", type=float, metavar="T",
        help="the weight-gradient share of --t-b, for split backwards I + W (default half of --t-b)",
    )
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print the schedule as JSON instead of the timeline")
    out.add_argument("--png", metavar="FILE", help="draw the timeline to a PNG file instead of printing it")
    return parser


def check_args(args: argparse.Namespace) -> None:
    """Raise ValueError, naming the flag, for values no schedule takes (each schedule's own rules come from
    the registry when the schedule is built)."""
    size_flag = "--workers" if args.workers is not None else "--stages"
    size = args.workers if args.workers is not None else args.stages
    for flag, value in ((size_flag, size), ("--micro-batches", args.micro_batches)):
        if value < 1:
            raise ValueError(f"{flag} must be a positive integer, got {value}; pass 1 or more, e.g. {flag} 4")
    for flag, value in (("--t-f", args.t_f), ("--t-b", args.t_b)):
        if not 0 < value < math.inf:
            raise ValueError(f"{flag} must be a positive cost, got {value:g}; e.g. {flag} 1")
    if args.t_w is not None and not 0 <= args.t_w <= args.t_b:
        raise ValueError(f"--t-w is the weight-gradient share of a backward, 0 ≤ t_w ≤ t_b = {args.t_b:g}, got "
                         f"{args.t_w:g}; e.g. --t-w {args.t_b / 2:g}")
    spec = get_spec(args.schedule)
    per_worker = args.chunks if args.chunks is not None and spec.chunks.choosable else spec.chunks.default
    if args.stages is not None and (per_worker != 1 or spec.chunks.choosable):
        raise ValueError(f"{args.schedule} holds {per_worker} stages per worker, so --stages is ambiguous; pass "
                         f"--workers P instead (S = {per_worker}·P stages), e.g. --workers {args.stages}")
    if args.pipelines is not None and args.pipelines < 1:
        raise ValueError(
            f"--pipelines must be a positive integer, got {args.pipelines}; omit it for the schedule's default"
        )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
        workers = args.workers if args.workers is not None else args.stages
        schedule = validate(build_schedule(args.schedule, workers, args.micro_batches, args.pipelines, args.concat,
                                           chunks=args.chunks, steps=args.steps,
                                           naming=CLI if args.workers is None else replace(CLI, stages="--workers")))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(schedule.to_json()))
        return 0
    sim = simulate(schedule, args.t_f, args.t_b, t_w=args.t_w)
    if args.png:
        try:
            save_png(sim, schedule, args.png, time_unit=f"cost units, t_f = {args.t_f:g}")
        except OSError as exc:
            reason = exc.strerror or exc
            print(f"error: --png cannot write {args.png!r}: {reason}; pick a writable path", file=sys.stderr)
            return 2
        print(f"wrote {args.png}")
        return 0
    setup = (f"D={schedule.stages}" if schedule.stages == schedule.num_workers
             else f"P={schedule.num_workers} S={schedule.stages}") + f" N={schedule.micro_batches}"
    if get_spec(args.schedule).concat:
        chosen = f"auto → {schedule.concat}" if args.concat == AUTO_CONCAT else schedule.concat
        setup += f" pipelines={schedule.pipelines} concat={chosen}"
    if "steps" in schedule.meta:
        setup = (f"D={schedule.stages} N={schedule.meta['micro_batches_per_step']} per update, "
                 f"{schedule.meta['steps']} updates without flushes, then the drain")
    split = any(a.kind in "IW" for acts in schedule.workers for a in acts)
    costs = f"t_f={args.t_f:g} t_b={args.t_b:g}" + (f" t_w={args.t_w if args.t_w is not None else args.t_b / 2:g}"
                                                    if split else "")
    print(f"{schedule.name}: {setup}, {costs}")
    print(ascii_timeline(sim, schedule))
    return 0


if __name__ == "__main__":
    sys.exit(main())
