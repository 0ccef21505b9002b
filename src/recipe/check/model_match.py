"""Whether a checkpoint holds this run's model, and which ``model.*`` overrides would make it so.

"The same model" is decided on the meta device (no memory, tens of milliseconds for any model of ``conf/model``):
both model configs are built as the workers build them (``instantiate(cfg["model"], device="meta")``) and every
parameter (a tied one once) and state-dict entry is compared by name and shape, which is what resuming needs
(:func:`pipeline_recipes.strategies.checkpoint.select_model_state` and the optimizer state by name). No list of
keys says which settings matter: a difference is explained by the smallest set of the keys in which the two configs
differ whose saved values, put into this run's config, build the checkpoint's model. Keys that change no parameter
(``compile``, ``loss_chunk_tokens``, ``seq_len``, ``name``, ...) drop out of that set on their own. ``pretrained``
is left out of the builds: it would read a hub config, and the model config's fields must agree with it anyway.

torch and transformers are imported by the builders, so only when a run resumes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from hydra.utils import instantiate

Shapes = dict[tuple[str, str], tuple[int, ...]]  # ("parameter" | "entry", name) -> shape
ABSENT = object()  # a key one of the two configs lacks
NOT_BUILT_HERE = ("pretrained",)  # reads a hub or local config.json; the fields given must agree with it anyway
PLAIN = re.compile(r"[A-Za-z_/][\w./-]*")  # a string Hydra's override grammar reads as itself, unquoted


def model_shapes(model_cfg: Mapping[str, Any]) -> Shapes:
    """Every parameter (tied ones once, by their first name) and state-dict entry of the model ``model_cfg``
    builds, by name and shape, built on the meta device as a pipeline worker builds it."""
    buildable = {k: (None if k in NOT_BUILT_HERE else v) for k, v in model_cfg.items()}
    model = instantiate(buildable, device="meta")
    shapes: Shapes = {("parameter", n): tuple(p.shape) for n, p in model.named_parameters()}
    shapes.update({("entry", n): tuple(t.shape) for n, t in model.state_dict().items()})
    return shapes


def builds(model_cfg: Mapping[str, Any], target: Shapes) -> bool:
    """Whether ``model_cfg`` builds a model of exactly the ``target`` parameters (False if it cannot be built)."""
    try:
        return model_shapes(model_cfg) == target
    except Exception:  # a combination of keys the builder refuses (e.g. n_embd not divisible by n_head)
        return False


def differing_keys(saved: Mapping[str, Any], run: Mapping[str, Any]) -> list[str]:
    """Keys whose values differ (or that one config lacks), in this run's order, then the saved-only ones."""
    keys = [*run, *(k for k in saved if k not in run)]
    return [k for k in keys if run.get(k, ABSENT) != saved.get(k, ABSENT)]


def with_saved(run: Mapping[str, Any], saved: Mapping[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    """This run's model config with the saved values of ``keys`` (a key the checkpoint lacks removed)."""
    out = dict(run)
    for key in keys:
        if key in saved:
            out[key] = saved[key]
        else:
            out.pop(key, None)
    return out


def keys_to_match(saved: Mapping[str, Any], run: Mapping[str, Any], target: Shapes) -> list[str] | None:
    """The fewest keys (each needed, given the others) whose saved values make this run's config build ``target``;
    None when even all the differing keys do not (the model code changed since the checkpoint was saved)."""
    needed = differing_keys(saved, run)
    if not builds(with_saved(run, saved, needed), target):
        return None
    for key in list(needed):
        fewer = [k for k in needed if k != key]
        if builds(with_saved(run, saved, fewer), target):
            needed = fewer
    return needed


def hydra_value(value: Any) -> str:
    """``value`` as Hydra's override grammar writes it: ``4``, ``1e-05``, ``true``, ``null``, ``gelu``, ``[1,2]``."""
    if isinstance(value, str):
        plain = PLAIN.fullmatch(value) and value.lower() not in ("true", "false", "null", "nan", "inf")
        return value if plain else "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    return json.dumps(value)


def override(key: str, saved: Mapping[str, Any], run: Mapping[str, Any]) -> str:
    """The command-line override that gives this run's ``model.<key>`` the saved value."""
    if key not in saved:
        return f"~model.{key}"
    return f"{'' if key in run else '+'}model.{key}={hydra_value(saved[key])}"


def first_difference(saved: Shapes, run: Shapes) -> str:
    """How many parameters (else state entries) differ, and the first of them in module order."""
    for kind, one, many in (("parameter", "parameter", "parameters"), ("entry", "state entry", "state entries")):
        mine = {n: s for (k, n), s in run.items() if k == kind}
        theirs = {n: s for (k, n), s in saved.items() if k == kind}
        differ = [n for n in [*mine, *(n for n in theirs if n not in mine)] if mine.get(n) != theirs.get(n)]
        if differ:
            name = differ[0]
            if name not in mine:
                example = f"{name} is only in the checkpoint"
            elif name not in theirs:
                example = f"{name} is only in this run's model"
            else:
                example = f"{name} is {theirs[name]} in the checkpoint, {mine[name]} here"
            count = f"1 {one} differs" if len(differ) == 1 else f"{len(differ)} {many} differ"
            return f"{count} in name or shape (e.g. {example})"
    return "its parameters differ"


def model_mismatch(saved_cfg: Mapping[str, Any], run_cfg: Mapping[str, Any]) -> str | None:
    """None when the checkpoint's model config (``saved_cfg``) builds this run's parameters; else what differs
    and the overrides that make this run build the checkpoint's model. A saved config that cannot be built here
    (a builder renamed since) is not judged: the workers still compare the tensors they load."""
    run = model_shapes(run_cfg)
    try:
        saved = model_shapes(saved_cfg)
    except Exception:  # any builder error: the saved config is not judged here
        return None
    if saved == run:
        return None
    message = f"holds another model than this run's: {first_difference(saved, run)}"
    if saved_cfg.get("name") != run_cfg.get("name"):
        message += f"; it was saved from model {saved_cfg.get('name')}, this run's is {run_cfg.get('name')}"
    keys = keys_to_match(saved_cfg, run_cfg, saved)
    if keys is None:
        return message + ("; no model.* setting makes this run's model the checkpoint's (the model code may have "
                          "changed since it was saved)")
    fix = " ".join(override(k, saved_cfg, run_cfg) for k in keys)
    now = ", ".join(f"{k}={hydra_value(run_cfg[k])}" if k in run_cfg else f"no {k}" for k in keys)
    return message + f"; to resume it, set {fix} (this run has {now})"
