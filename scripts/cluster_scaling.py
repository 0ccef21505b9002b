#!/usr/bin/env python
"""Every schedule of the registry on a described cluster at several scales: predicted throughput against GPUs.

    python scripts/cluster_scaling.py --cluster dgx-h100 --model gpt2 --gpus 64,128,256,512,1024 \\
        --samples-per-gpu 1 --out benchmarks/dgx_h100_scaling.json --plot benchmarks/dgx_h100_scaling.png

Weak scaling as in the Chimera paper's §4.2.3 (the global batch grows with the GPUs: ``--samples-per-gpu``); each
point is ``scripts/plan.py cluster=<name> ... --compare`` (times derived from FLOPs, said in the record).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def plan_point(cluster: str, model: str, gpus: int, global_batch: int, per_node: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        subprocess.run([sys.executable, str(ROOT / "scripts" / "plan.py"), f"cluster={cluster}", f"model={model}",
                        f"trainer.devices={per_node}", f"trainer.num_nodes={gpus // per_node}",
                        f"data.global_batch_size={global_batch}", "--compare", "--top", "1", "--json", str(out)],
                       check=True, capture_output=True)
        record = json.loads(out.read_text())
        record.pop("rows", None)
        return record


def plot(points: dict[int, dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    names = sorted({n for p in points.values() for n in p["best_per_schedule"]})
    for name in names:
        xs = [g for g, p in sorted(points.items()) if (p["best_per_schedule"].get(name) or {}).get("fits")]
        ys = [points[g]["best_per_schedule"][name]["samples_per_s"] for g in xs]
        if xs:
            ax.plot(xs, ys, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("predicted samples/s (best fitting layout)")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cluster", default="dgx-h100")
    p.add_argument("--model", default="gpt2")
    p.add_argument("--gpus", default="64,128,256,512,1024")
    p.add_argument("--samples-per-gpu", type=int, default=1)
    p.add_argument("--per-node", type=int, default=8, help="trainer.devices (GPUs per node)")
    p.add_argument("--out", required=True)
    p.add_argument("--plot")
    args = p.parse_args(argv)
    points = {}
    for gpus in (int(g) for g in args.gpus.split(",")):
        points[gpus] = plan_point(args.cluster, args.model, gpus, gpus * args.samples_per_gpu, args.per_node)
        print(f"{gpus} GPUs: planned in {points[gpus]['planning_s']:.1f} s", flush=True)
    record = {"command": "python scripts/cluster_scaling.py " + " ".join(argv or sys.argv[1:]), "points": points}
    Path(args.out).write_text(json.dumps(record, indent=1))
    if args.plot:
        plot(points, args.plot, f"{args.model} on {args.cluster}, {args.samples_per_gpu} sample(s) per GPU per step")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
