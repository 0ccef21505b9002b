#!/usr/bin/env python
"""Show a pipeline schedule: ASCII timeline (default), PNG picture or JSON data.

    python scripts/schedule.py chimera --stages 4 --micro-batches 4
    python scripts/schedule.py dapple --stages 4 --micro-batches 8 --t-f 1 --t-b 1
    python scripts/schedule.py chimera --stages 8 --micro-batches 16 --pipelines 4 --png chimera.png
    python scripts/schedule.py gpipe --stages 4 --micro-batches 4 --json
    python scripts/schedule.py gems --stages 4 --micro-batches 4
    python scripts/schedule.py chimera --stages 4 --micro-batches 16 --concat auto
    python scripts/schedule.py pipedream_2bw --stages 4 --micro-batches 4 --steps 3   (asynchronous: no flushes)

Invalid settings exit with status 2 and an ``error: ...`` line naming the setting and a fix.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from pipeline_recipes.strategies.schedules import (
    ASYNC_SCHEDULES, AUTO_CONCAT, CONCAT_METHODS, build_schedule, resolve_concat, simulate, validate,
)
from pipeline_recipes.strategies.schedules.asynchronous import run as async_run
from pipeline_recipes.strategies.schedules.render import ascii_timeline, save_png

NAMES = ("gpipe", "dapple", "gems", "chimera", "pipedream_2bw", "pipedream")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="schedule.py",
        description="Build a pipeline schedule, simulate it and show its timeline (Chimera paper, Figures 2-3).",
        epilog="Times and costs are in arbitrary units; only the ratio t_b / t_f shapes the timeline.",
    )
    parser.add_argument("schedule", choices=NAMES, help="schedule to build")
    parser.add_argument("--stages", type=int, required=True, metavar="D", help="pipeline stages = workers (D)")
    parser.add_argument("--micro-batches", type=int, required=True, metavar="N", help="micro-batches per iteration (N)")
    parser.add_argument(
        "--pipelines", type=int, metavar="P",
        help="chimera only: number of pipelines, 2f for a divisor f of D/2 (default 2)",
    )
    parser.add_argument(
        "--concat", choices=(*CONCAT_METHODS, AUTO_CONCAT),
        help="chimera only: how units of D micro-batches are concatenated when N > D (default direct); auto: "
             "the fastest at t_b = 2 t_f, as strategy.concat=auto picks it for an even micro-batch size",
    )
    parser.add_argument(
        "--steps", type=int, metavar="T",
        help="pipedream_2bw / pipedream only: optimizer steps shown back to back, then the drain (default 3)",
    )
    parser.add_argument(
        "--t-f", type=float, default=1.0, metavar="T",
        help="simulated cost of one stage's forward of one micro-batch (default 1.0)",
    )
    parser.add_argument(
        "--t-b", type=float, default=2.0, metavar="T",
        help="simulated cost of one stage's backward of one micro-batch (default 2.0, i.e. twice the forward)",
    )
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print the schedule as JSON instead of the timeline")
    out.add_argument("--png", metavar="FILE", help="draw the timeline to a PNG file instead of printing it")
    return parser


def check_args(args: argparse.Namespace) -> None:
    """Raise ValueError, naming the flag, for settings build_schedule does not see as flags."""
    for flag, value in (("--stages", args.stages), ("--micro-batches", args.micro_batches)):
        if value < 1:
            raise ValueError(f"{flag} must be a positive integer, got {value}; pass 1 or more, e.g. {flag} 4")
    for flag, value in (("--t-f", args.t_f), ("--t-b", args.t_b)):
        if not 0 < value < math.inf:
            raise ValueError(f"{flag} must be a positive cost, got {value:g}; e.g. {flag} 1")
    if args.pipelines is not None and args.pipelines < 1:
        raise ValueError(
            f"--pipelines must be a positive integer, got {args.pipelines}; omit it for the default (2 for chimera)"
        )
    if args.steps is not None and (args.schedule not in ASYNC_SCHEDULES or args.steps < 1):
        raise ValueError(f"--steps takes a positive number of steps for {' or '.join(ASYNC_SCHEDULES)} (their "
                         f"windows run without flushes), got --steps {args.steps} for {args.schedule}; drop --steps")
    if args.schedule != "chimera":
        fixed = 2 if args.schedule == "gems" else 1
        if args.pipelines not in (None, fixed):
            runs = "two opposite pipelines" if fixed == 2 else "a single pipeline"
            raise ValueError(
                f"--pipelines applies to chimera only: {args.schedule} runs {runs}, got --pipelines "
                f"{args.pipelines}; drop --pipelines, or use 'chimera --pipelines {args.pipelines}'"
            )
        if args.concat is not None:
            raise ValueError(
                f"--concat applies to chimera only: {args.schedule} has no basic units to concatenate, got "
                f"--concat {args.concat}; drop --concat, or use 'chimera --concat {args.concat}'"
            )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
        if args.schedule in ASYNC_SCHEDULES:
            schedule = validate(async_run(args.schedule, args.stages, args.micro_batches, args.steps or 3))
        else:
            concat = resolve_concat(args.schedule, args.stages, args.micro_batches, args.pipelines, None,
                                    args.concat or "direct")
            schedule = validate(
                build_schedule(args.schedule, args.stages, args.micro_batches, args.pipelines, concat)
            )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(schedule.to_json()))
        return 0
    sim = simulate(schedule, args.t_f, args.t_b)
    if args.png:
        try:
            save_png(sim, schedule, args.png)
        except OSError as exc:
            reason = exc.strerror or exc
            print(f"error: --png cannot write {args.png!r}: {reason}; pick a writable path", file=sys.stderr)
            return 2
        print(f"wrote {args.png}")
        return 0
    setup = f"D={schedule.stages} N={schedule.micro_batches}"
    if schedule.name == "chimera":
        chosen = f"auto → {schedule.concat}" if args.concat == AUTO_CONCAT else schedule.concat
        setup += f" pipelines={schedule.pipelines} concat={chosen}"
    if "steps" in schedule.meta:
        setup = (f"D={schedule.stages} N={schedule.meta['micro_batches_per_step']} per update, "
                 f"{schedule.meta['steps']} updates without flushes, then the drain")
    print(f"{schedule.name}: {setup}, t_f={args.t_f:g} t_b={args.t_b:g}")
    print(ascii_timeline(sim, schedule))
    return 0


if __name__ == "__main__":
    sys.exit(main())
