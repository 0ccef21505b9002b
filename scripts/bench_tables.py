#!/usr/bin/env python
"""BENCHMARKS.md's tables, printed as Markdown from the committed JSON records.

    python scripts/bench_tables.py benchmarks/bench.json [--plan benchmarks/plan_accuracy.json]

Every number in the tables comes from the files: ``scripts/bench.py``'s (§1–§4 and the end-to-end
section) and ``scripts/plan_accuracy.py``'s (§5). Nothing is measured here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def _fmt(v: Any, digits: int = 4) -> str:
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def table(columns: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def meta_lines(data: dict[str, Any]) -> str:
    meta = data.get("meta") or {}
    m = meta.get("machine") or {}
    out = [f"Run: `{meta.get('command', '?')}`, started {meta.get('started_utc', '?')}, "
           f"{meta.get('wall_s', 0) / 60:.1f} min in all; commit {str(m.get('git_commit', '?'))[:10]}"
           f"{' (with uncommitted changes)' if m.get('git_dirty') else ''}.",
           f"Machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores, {m.get('memory_gib') or 0:.0f} GiB, "
           f"Python {m.get('python', '?')}, torch {m.get('torch', '?')}.", "",
           table(["part", "wall s", "load average before (1/5/15 min)", "after"],
                 [[p, v["wall_s"], " / ".join(f"{x:.1f}" for x in v["load_average_before"]),
                   " / ".join(f"{x:.1f}" for x in v["load_average_after"])] for p, v in meta.get("parts", {}).items()])]
    return "\n".join(out)


def efficiency(data: dict[str, Any]) -> str:
    rows = (data.get("details") or {}).get("schedule_efficiency") or data["schedule_efficiency"]
    body = [[r["schedule"], r["D"], r["N"], r["measured_s"], r["simulated_s"], round(r["ratio"], 3),
             r.get("simulated_actions_s", ""), round(r["ratio_actions"], 3) if "ratio_actions" in r else "",
             "" if r.get("hop_ms") is None else r["hop_ms"]]
            for r in rows]
    return table(["schedule", "D", "N", "measured_s", "simulated_s", "ratio", "simulated_actions_s", "ratio_actions",
                  "hop_ms"], body)


def chimera_vs_dapple(data: dict[str, Any]) -> str:
    versus = [[r["D"], r["N"], r["measured_ratio"], r["theory_ratio"],
               f"{(r['measured_ratio'] / r['theory_ratio'] - 1) * 100:+.1f} %"] for r in data["chimera_vs_dapple"]]
    return table(["D", "N", "measured_ratio", "theory_ratio", "deviation"], versus)


def vs_torch(data: dict[str, Any]) -> str:
    medians = {r["system"]: r["median_s"] for r in (data.get("details") or {}).get("vs_torch_times", [])}
    rows = [[r["ours"], r["theirs"], round(r["throughput_ratio"], 3), medians.get(f"ours:{r['ours']}", ""),
             medians.get(f"theirs:{r['theirs']}", "")] for r in data["vs_torch"]]
    return table(["ours", "theirs", "throughput_ratio (paired)", "ours median s", "theirs median s"], rows)


def bidirectional(data: dict[str, Any]) -> str:
    medians = {r["system"]: r["median_s"] for r in (data.get("details") or {}).get("vs_torch_times", [])}
    rows = [[r["schedule"], r["versus"], round(r["throughput_ratio"], 3), medians.get(f"ours:{r['schedule']}", ""),
             medians.get(f"ours:{r['versus']}", "")] for r in data.get("bidirectional", [])]
    return table(["schedule", "versus", "throughput_ratio (paired)", "median s", "versus median s"], rows)


def overhead(data: dict[str, Any]) -> str:
    t = (data.get("details") or {}).get("overhead_times") or {}
    return (f"overhead_d1 = **{data['overhead_d1']:.4f}** (median of per-round ratios; medians: plain "
            f"{t.get('plain_s', float('nan')):.4f} s, engine {t.get('engine_s', float('nan')):.4f} s)")


def grad_sync(data: dict[str, Any]) -> str:
    return table(["schedule", "D", "W", "N", "mode", "measured_s", "ratio_vs_end"],
                 [[r["schedule"], r["D"], r["W"], r["N"], r["mode"], r["measured_s"], round(r["ratio_vs_end"], 3)]
                  for r in data["grad_sync"]])


def recompute(data: dict[str, Any]) -> str:
    return table(["mode", "peak stored bytes by rank", "memory_ratio (max rank)", "measured_s", "time_ratio"],
                 [[r["mode"], " / ".join(f"{b:,}" for b in r["peak_stored_bytes_by_rank"]), round(r["memory_ratio"], 4),
                   r["measured_s"], round(r["time_ratio"], 3)] for r in data["recompute"]])


def e2e(data: dict[str, Any]) -> str:
    """Per job: the same-named torch class, torch's best per round and the bare engine; then every
    job against every torch class (throughput ratios, > 1: ``train.py`` faster)."""
    by_job: dict[str, dict[str, dict]] = {}
    for r in data.get("e2e_vs_torch") or []:
        by_job.setdefault(r["ours"], {})[r["theirs"]] = r
    summary, classes = [], []
    for job, rows in by_job.items():
        same = next((r for r in rows.values() if r.get("same_schedule")), None)
        engine = next((r for k, r in rows.items() if k.startswith("engine:")), None)
        best = rows.get("torch best")
        classes += [k for k in rows if k not in classes and k != "torch best" and not k.startswith("engine:")]
        any_row = next(iter(rows.values()))
        summary.append([job, any_row["ours_median_s"],
                        f"{same['theirs']} {same['throughput_ratio']:.3f}" if same else "-",
                        f"{best.get('best_class', '')} {best['throughput_ratio']:.3f}".strip() if best else "-",
                        round(engine["throughput_ratio"], 3) if engine else "-", any_row["rounds"]])
    out = [table(["ours", "ours median s", "vs torch's class of the same schedule", "vs torch's best class (lowest median)",
                  "vs bare engine", "rounds"], summary)]
    if classes:
        matrix = [[job, *(round(rows[c]["throughput_ratio"], 3) if c in rows else "-" for c in classes)]
                  for job, rows in by_job.items()]
        matrix.append(["(torch median s in the first job's rounds)",
                       *(next(iter(by_job.values()))[c]["theirs_median_s"] if c in next(iter(by_job.values())) else "-"
                         for c in classes)])
        out.append(table(["ours \\ theirs", *classes], matrix))
    e = data.get("e2e_overhead_d1")
    if e:
        out.append(table(["train.py strategy=single median s", "plain Lightning median s", "ratio (paired)", "rounds"],
                         [[e["train_py_median_s"], e["plain_lightning_median_s"], round(e["ratio"], 4), e["rounds"]]]))
    return "\n\n".join(out)


def _pct(x: float) -> str:
    return f"{x * 100:.1f} %"


def plan_accuracy(plan: dict[str, Any]) -> str:
    s = plan["summary"]
    by = s.get("by_compute", {})
    summary_rows = [["counted layouts (not oversubscribed)", s["layouts"], _pct(s["time_error_median"]),
                     _pct(s["time_error_max"])]]
    summary_rows += [[f"  {kind} compute", e["layouts"], _pct(e["time_error_median"]), _pct(e["time_error_max"])]
                     for kind, e in by.items()]
    if "oversubscribed_layouts" in s:
        summary_rows.append(["oversubscribed (real compute, more ranks than cores)", s["oversubscribed_layouts"],
                             _pct(s["oversubscribed_time_error_median"]), _pct(s["oversubscribed_time_error_max"])])
    if "all_layouts" in s:
        summary_rows.append(["**every layout**", s["all_layouts"], _pct(s["all_time_error_median"]),
                             _pct(s["all_time_error_max"])])
    summary_rows.append(["peak memory per rank, every layout", len(plan["rows"]), _pct(s["memory_error_median"]),
                         _pct(s["memory_error_max"])])
    picks = [[p["compute"], p["devices"], p["global_batch_size"], p["layouts"], p["recommended"], p["best_measured"],
              f"{p['ratio']:.3f}"] for p in s.get("recommended_vs_best", [])]
    rows = []
    for r in plan["rows"]:
        repeats = ", ".join(f"{x['time_error'] * 100:.1f}" for x in r.get("repeats", []))
        rows.append([r["compute"], r["layout"], r["W"], r["D"], r["B"], r["N"], r["recompute"], r["grad_sync"],
                     f"{r['predicted_s']:.4f}", f"{r['measured_s']:.4f}",
                     _pct(r["time_error"]) + (" (oversubscribed)" if r["oversubscribed"] else ""), repeats,
                     _pct(r["memory_error"])])
    return "\n\n".join([
        table(["rows", "layouts", "time error median", "time error max"], summary_rows),
        table(["compute", "processes", "B̂", "layouts measured", "planner's pick", "best measured", "pick ÷ best"], picks),
        table(["compute", "layout", "W", "D", "B", "N", "recompute", "grad_sync", "predicted_s", "measured_s",
               "time error (medians)", "per repeat (%)", "memory error"], rows)])


SECTIONS = {"meta": meta_lines, "efficiency": efficiency, "chimera_vs_dapple": chimera_vs_dapple, "vs_torch": vs_torch,
            "bidirectional": bidirectional, "overhead": overhead,
            "grad_sync": grad_sync, "recompute": recompute, "e2e": e2e}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bench", help="scripts/bench.py's JSON")
    p.add_argument("--plan", help="scripts/plan_accuracy.py's JSON")
    args = p.parse_args(argv)
    data = json.loads(Path(args.bench).read_text())
    for name, render in SECTIONS.items():
        print(f"<!-- {name} -->\n{render(data)}\n")
    if args.plan:
        print(f"<!-- plan_accuracy -->\n{plan_accuracy(json.loads(Path(args.plan).read_text()))}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
