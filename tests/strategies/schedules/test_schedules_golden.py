"""Golden action lists: every registered schedule, with every option the user may choose, over a grid of
sizes (odd ones included), compared with ``tests/golden/schedules.json``.

The file is a snapshot of the generators' output (each worker's actions in their text form, or the
registry's refusal message), recorded once so that a refactoring of the generators keeps every order
exactly; torch's own orders are compared in ``tests/strategies/schedules/test_modern_schedules.py``. A schedule registered
after the snapshot has no entry and is not compared. Re-record deliberately, after checking
the new orders against torch or the papers, with ``python tests/strategies/schedules/test_schedules_golden.py --write``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from pipeline_recipes.strategies.schedules import (
    SCHEDULES, Schedule, ScheduleError, ScheduleSpec, build_schedule, specs, validate,
)
from pipeline_recipes.strategies.schedules.asynchronous import window
from pipeline_recipes.strategies.schedules.one_f_one_b import numbered, one_f_one_b, one_stage_per_worker

GOLDEN = Path(__file__).resolve().parents[3] / "tests" / "golden" / "schedules.json"
STAGES = tuple(range(1, 9))
MICRO_BATCHES = (1, 2, 3, 4, 5, 7, 8, 9, 12)
CHIMERA_MICRO_BATCHES = (1, 2, 3, 4, 5, 6, 8, 9, 12, 16)  # units of D: 0, 1, 2 full units and residues
CHUNKS = (2, 3)
STEPS = (1, 2, 3)
CONCAT_METHODS = ("direct", "forward_doubling", "backward_halving")


def _cases(spec: ScheduleSpec) -> Iterator[tuple[str, dict[str, object]]]:
    """(key, build_schedule keyword arguments) for every size and option of ``spec``."""
    stages = STAGES if not spec.concat else (1, 2, 3, 4, 6, 8)
    for d in stages:
        if spec.fixed_micro_batches:
            ns: tuple[int, ...] = (spec.fixed_micro_batches, spec.fixed_micro_batches + 1)
        elif spec.concat:
            ns = CHIMERA_MICRO_BATCHES if d <= 4 else (d // 2, d, d + 1, 2 * d)[: 4 if d < 8 else 3]
        else:
            ns = MICRO_BATCHES
        for n in ns:
            options: list[dict[str, object]] = [{}]
            if spec.pipelines.choices is not None:
                pipes = tuple(spec.pipelines.choices(d)) or (spec.pipelines.default,)
                options = [{"pipelines": p, "concat": c} for p in pipes for c in CONCAT_METHODS]
            if spec.chunks.choosable:
                options = [{**o, "chunks": v} for o in options for v in CHUNKS]
            if spec.asynchronous:
                options = [{**o, "steps": t} for o in options for t in STEPS]
            for o in options:
                key = "|".join([spec.name, f"D={d}", f"N={n}", *(f"{k}={v}" for k, v in o.items())])
                yield key, {"stages": d, "micro_batches": n, **o}


def _record(kwargs: dict[str, object], name: str) -> list[str] | dict[str, str]:
    try:
        schedule = build_schedule(name, **kwargs)  # type: ignore[arg-type]
    except ScheduleError as err:
        return {"error": str(err)}
    return [" ".join(map(str, acts)) for acts in schedule.workers]


def _windows() -> Iterator[tuple[str, list[str]]]:
    """The asynchronous schedules' per-step windows (what the runtime runs), at valid sizes."""
    for spec in specs():
        if not spec.asynchronous:
            continue
        for d in (1, 2, 3, 4, 5):
            for n in ((spec.fixed_micro_batches,) if spec.fixed_micro_batches else (d, d + 1, 2 * d + 1)):
                for step in (0, 1, 2):
                    schedule = window(spec.name, d, n, step)
                    yield f"window|{spec.name}|D={d}|N={n}|step={step}", [" ".join(map(str, a)) for a in
                                                                            schedule.workers]


def current() -> dict[str, object]:
    out: dict[str, object] = {}
    for spec in specs():
        for key, kwargs in _cases(spec):
            out[key] = _record(kwargs, spec.name)
    out.update(_windows())
    return out


@pytest.mark.slow
def test_every_schedule_keeps_its_recorded_actions() -> None:
    golden = json.loads(GOLDEN.read_text())
    now = current()
    recorded = [k for k in now if k in golden]
    assert len(recorded) > 1000, "the golden file covers too little; re-record it"
    changed = [k for k in recorded if now[k] != golden[k]]
    assert not changed, f"{len(changed)} changed, e.g. {changed[:5]}: {now[changed[0]]} != {golden[changed[0]]}"
    missing = sorted({k.split("|")[0] for k in golden if k not in now and not k.startswith("window|")})
    assert not missing, f"recorded schedules no longer produced for these settings: {missing}"


def test_the_snapshot_has_every_family_and_refusals() -> None:
    golden = json.loads(GOLDEN.read_text())
    families = {k.split("|")[0] for k in golden if not k.startswith("window|")}
    assert {"gpipe", "dapple", "gems", "chimera", "interleaved_1f1b", "zb_h1", "zb_h2", "zbv", "dualpipev",
            "chimera_zb", "pipedream", "pipedream_2bw"} <= families
    assert any(isinstance(v, dict) for v in golden.values())  # a refusal is recorded with its message


def test_the_1f1b_builder_by_hand() -> None:
    """The builder's parameters on small cases written out by hand from 1F1B's definition."""
    f = numbered("F", lambda _: 0, 4)
    b = numbered("B", lambda _: 0, 4)
    text = lambda acts: " ".join(map(str, acts))  # noqa: E731
    assert text(one_f_one_b(f, b, warmup=2)) == "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3"
    assert text(one_f_one_b(f, b, warmup=9)) == "0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3"  # warm-up capped at N
    assert text(one_f_one_b(f, b, warmup=1, backward_first=True)) == "0F0 0B0 0F1 0B1 0F2 0B2 0F3 0B3"
    assert text(one_f_one_b(f, b, warmup=2, cool_down=False)) == "0F0 0F1 0F2 0B0 0F3 0B1"
    i = numbered("I", lambda _: 0, 4)
    assert text(one_f_one_b(f, i, warmup=1, weight_lag=1)) == "0F0 0F1 0I0 0F2 0I1 0W0 0F3 0I2 0W1 0I3 0W2 0W3"
    chunks = numbered("F", lambda k: 2 * (k // 2 % 2), 4)  # depth first over stages 0 and 2, rounds of 2
    assert text(chunks) == "0F0 0F1 2F0 2F1"


def test_a_1f1b_variant_is_one_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new 1F1B variant (here one more warm-up forward per stage) is a spec whose generator calls the
    builder; the registry builds and checks it like any other schedule."""
    def generator(stages: int, micro_batches: int) -> Schedule:
        return one_stage_per_worker("eager_1f1b", stages, micro_batches, lambda s: stages - s)

    monkeypatch.setitem(SCHEDULES, "eager_1f1b", ScheduleSpec("eager_1f1b", generator, "1F1B, one more warm-up"))
    schedule = validate(build_schedule("eager_1f1b", 2, 3))
    assert [" ".join(map(str, acts)) for acts in schedule.workers] == ["0F0 0F1 0F2 0B0 0B1 0B2",
                                                                        "1F0 1F1 1B0 1F2 1B1 1B2"]
    with pytest.raises(ScheduleError, match="micro_batches must be a positive integer"):
        build_schedule("eager_1f1b", 2, 0)


def test_the_registry_validates_what_a_generator_produces(monkeypatch: pytest.MonkeyPatch) -> None:
    """A generator that loses an action (here stage 1's last backward) is caught by ``build_schedule``
    before anyone runs it: the registry checks what generators produce, not only their settings."""
    def generator(stages: int, micro_batches: int) -> Schedule:
        schedule = one_stage_per_worker("lossy_1f1b", stages, micro_batches, lambda s: stages - 1 - s)
        return replace(schedule, workers=(schedule.workers[0], schedule.workers[1][:-1]))

    monkeypatch.setitem(SCHEDULES, "lossy_1f1b", ScheduleSpec("lossy_1f1b", generator, "1F1B, one action lost"))
    with pytest.raises(ValueError, match="lossy_1f1b.* is invalid"):
        build_schedule("lossy_1f1b", 2, 3)


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/strategies/schedules/test_schedules_golden.py --write  (re-records the snapshot)")
    GOLDEN.parent.mkdir(exist_ok=True)
    data = current()
    GOLDEN.write_text("{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}"
                                          for k, v in data.items()) + "\n}\n", encoding="utf-8")
    print(f"{len(data)} entries, {GOLDEN.stat().st_size} bytes")
