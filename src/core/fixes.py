"""A refusal's fixes as data: each fix is a set of Hydra overrides (``key=value``, as typed after ``train.py``)
that together make the refused command pass, and the message is rendered from them.

A check that refuses a command raises :class:`ConfigError` with its *problem* (the settings, their values and
the rule) and its *proposals* (:class:`Proposal`): candidate fixes, best first, generous rather than clever.
:func:`vet` keeps the ones that pass when applied to the same command, asking the checks themselves (so no
rule is written a second time to compute a suggestion), and renders what is left. Where no proposal passes,
the refused setting has no working value here: the error says so and offers its *alternatives* instead (other
devices, layers or schedule), vetted the same way; where the command breaks other rules too, a fix combines a
proposal with the fixes of the rules that then refuse it. Without vetting (a check called on its own) the
message shows the proposals as the refusing rule made them.

Values are written as on the command line (:func:`override_text`): ``null``, ``true``, ``8``, ``direct``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Fix = dict[str, str]
"""Hydra overrides (key → value as typed) that together fix a command; a key without a dot is a config group."""


def override_text(value: Any) -> str:
    """A value as typed in a Hydra override: ``null``, ``true``/``false``, a number or a word."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def override_value(text: str) -> Any:
    """The value of an override written by :func:`override_text` (its inverse)."""
    if text in ("null", "true", "false"):
        return {"null": None, "true": True, "false": False}[text]
    try:
        return int(text)
    except ValueError:
        return text


@dataclass(frozen=True)
class Proposal:
    """Candidate fixes of one kind, best first: vetting keeps the first ``keep`` that pass (None: all that pass).
    ``lead`` opens the message's fixes when one of these is the first shown (e.g. ``did you mean 'eager'?``);
    ``keys``: the settings it changes (also when it has no candidate)."""

    fixes: tuple[Fix, ...]
    keep: int | None = None
    lead: str = ""
    keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.keys:
            object.__setattr__(self, "keys", tuple(dict.fromkeys(k for fix in self.fixes for k in fix)))


def values(key: str, candidates: Iterable[Any], keep: int | None = None, lead: str = "") -> Proposal:
    """One fix per candidate value of ``key``."""
    return Proposal(tuple({key: override_text(v)} for v in candidates), keep, lead, (key,))


def fixes_of(*fixes: Mapping[str, Any], keep: int | None = None, lead: str = "") -> Proposal:
    """A proposal of whole fixes (several overrides each), values written by :func:`override_text`."""
    return Proposal(tuple({k: override_text(v) for k, v in fix.items()} for fix in fixes), keep, lead)


def _first(proposal: Proposal, passes: Callable[[Fix], bool] | None, seen: list[Fix]) -> list[Fix]:
    """The fixes of ``proposal`` that pass (all, without ``passes``), at most ``keep``, none already in ``seen``."""
    kept: list[Fix] = []
    for fix in proposal.fixes:
        if proposal.keep is not None and len(kept) >= proposal.keep:
            break
        if fix in seen or fix in kept:
            continue
        if passes is None or passes(fix):
            kept.append(fix)
    return kept


Groups = tuple[tuple[str, tuple[Fix, ...]], ...]


def _groups(proposals: Sequence[Proposal], passes: Callable[[Fix], bool] | None) -> Groups:
    """Each proposal's lead and the fixes :func:`_first` keeps of it (proposals that keep none left out)."""
    seen: list[Fix] = []
    out = []
    for proposal in proposals:
        kept = _first(proposal, passes, seen)
        seen += kept
        if kept:
            out.append((proposal.lead, tuple(kept)))
    return tuple(out)


def _clause(fixes: Sequence[Fix]) -> str:
    """Whole fixes ``k1=v1 k2=v2`` joined by ``or``; three values or more of one key: ``k to one of [a, b, c]``."""
    keys = {tuple(fix) for fix in fixes}
    if len(fixes) > 2 and len(keys) == 1 and len(next(iter(keys))) == 1:
        key = next(iter(keys))[0]
        return f"{key} to one of [{', '.join(fix[key] for fix in fixes)}]"
    return " or ".join(" ".join(f"{k}={v}" for k, v in fix.items()) for fix in fixes)


def _merged(groups: Groups) -> list[tuple[Fix, ...]]:
    """Adjacent groups that set the same one key become one (``k to one of [a, b]``)."""
    out: list[tuple[Fix, ...]] = []
    for _, fixes in groups:
        keys = {tuple(fix) for fix in fixes}
        if out and len(keys) == 1 and {tuple(fix) for fix in out[-1]} == keys and len(next(iter(keys))) == 1:
            out[-1] = out[-1] + fixes
        else:
            out.append(fixes)
    return out


def render_fixes(groups: Groups) -> str:
    """The fixes in words: ``set a=1, or b to one of [2, 4], or c=3 d=4`` (a first group's lead before it)."""
    if not groups:
        return ""
    lead = groups[0][0]
    rest = _merged(groups[1:]) if lead else _merged(groups)
    clauses = [_clause(groups[0][1])] + [_clause(f) for f in rest] if lead else [_clause(f) for f in rest]
    return (f"{lead} " if lead else "") + "set " + ", or ".join(clauses)


class ConfigError(ValueError):
    """An invalid combination of settings, explained: ``problem`` (the settings, their values and the rule) and
    ``fixes`` (:data:`Fix` each, best first), the message rendered from both.

    ``proposals`` are the candidate fixes before :func:`vet`; ``alternatives`` (or a function that makes them, called
    only when vetting needs them) the other changes offered when none of them passes (``stuck``: the message then
    says that no value of :attr:`setting` works). An error raised with a plain message has neither and says what it
    says."""

    def __init__(self, problem: str, proposals: Iterable[Proposal] = (), *,
                 alternatives: Iterable[Proposal] | Callable[[], Iterable[Proposal]] = ()) -> None:
        self.problem = problem
        self.proposals = tuple(proposals)
        self._alternatives = alternatives
        self.stuck = False
        self.vetted = False
        self._groups = _groups(self.proposals, None)
        super().__init__(self.render())

    @property
    def alternatives(self) -> tuple[Proposal, ...]:
        """What else may be changed where no proposal passes (other devices, layers or schedule)."""
        if callable(self._alternatives):
            self._alternatives = tuple(self._alternatives())
        return tuple(self._alternatives)

    @property
    def fixes(self) -> list[Fix]:
        """The fixes the message proposes, best first (each a set of overrides applied together)."""
        return [dict(fix) for _, fixes in self._groups for fix in fixes]

    @property
    def setting(self) -> str:
        """The refused setting(s) in words: those its proposals change, config groups left out."""
        return " or ".join(k for k in self.refused if "." in k)

    @property
    def refused(self) -> tuple[str, ...]:
        """The settings the proposals change (those of which no value works when ``stuck``)."""
        return tuple(dict.fromkeys(k for p in self.proposals for k in p.keys))

    def render(self) -> str:
        """The message: the problem, then (when stuck) that no value of the setting works, then the fixes."""
        text = self.problem
        fixes = render_fixes(self._groups)
        if self.stuck:
            text += (f"; no value of {self.setting} passes every check with the other settings as they are"
                     + (f", so change something else: {fixes}" if fixes else
                        ", nor does any other change tried (other devices, more layers or another schedule)"))
        elif fixes:
            text += f"; {fixes}"
        return text

    def with_groups(self, groups: Groups, stuck: bool) -> ConfigError:
        """This error with other (vetted) fixes, its message rendered anew."""
        out = copy.copy(self)
        out._groups, out.stuck, out.vetted = groups, stuck, True
        out.args = (out.render(),)
        return out

    def __reduce__(self) -> tuple:
        """Pickled with its fixes (alternatives not made yet are left out: they may need this process)."""
        state = {**self.__dict__, "_alternatives": () if callable(self._alternatives) else self._alternatives}
        return _rebuild, (type(self), state)


def _rebuild(cls: type[ConfigError], state: dict[str, Any]) -> ConfigError:
    error = cls.__new__(cls)
    error.__dict__.update(state)
    error.args = (error.render(),)
    return error


Check = Callable[[Fix], "ValueError | None"]
"""The checks of a command with a fix applied: None where it passes, else the refusal (a :class:`ConfigError`
carries its own proposals, which :func:`vet` may combine with the fix)."""

COMPOUND_TRIES = 16  # refused fixes whose next refusal vet tries to fix too (all levels together)
COMPOUND_FOLLOW = 2  # of them, per proposal
COMPOUND_LOOK = 8  # fixes of each proposal looked at for a compound
COMPOUND_KEEP = 2  # compound fixes proposed
COMPOUND_DEPTH = 3  # other rules a compound fix may also satisfy (a command may break four rules at once)


def vet(error: ConfigError, check: Check) -> ConfigError:
    """``error`` with the proposals that pass (``check(fix)`` is None: the command with ``fix`` applied passes
    every check). Where none does, it is stuck: the alternatives that pass, else a proposal together with fixes of
    the other rules that then refuse it (a command can break several rules), else an alternative with such fixes.
    An error without proposals is returned as is."""
    if not error.proposals or not isinstance(error, ConfigError):
        return error
    verdicts: dict[tuple, ValueError | None] = {}

    def verdict(fix: Fix) -> ValueError | None:
        key = tuple(sorted(fix.items()))
        if key not in verdicts:
            verdicts[key] = check(fix)
        return verdicts[key]

    def passes(fix: Fix) -> bool:
        return verdict(fix) is None

    groups = _groups(error.proposals, passes)
    if groups:
        return error.with_groups(groups, stuck=False)
    tries = [COMPOUND_TRIES]
    return error.with_groups(_groups(error.alternatives, passes)
                             or _compounds(error.proposals, verdict, COMPOUND_DEPTH, tries, COMPOUND_KEEP)
                             or _compounds(error.alternatives, verdict, COMPOUND_DEPTH, tries, COMPOUND_KEEP),
                             stuck=True)


def _compounds(proposals: Sequence[Proposal], verdict: Callable[[Fix], ValueError | None], depth: int,
               tries: list[int], keep: int) -> Groups:
    """Up to ``keep`` proposals refused by another rule (one about a setting they do not change), each with the
    first fix of that refusal which makes both pass, ``{**proposal, **fix}`` (up to ``depth`` rules deep);
    ``COMPOUND_FOLLOW`` refused fixes followed per proposal and ``tries`` in all."""
    found: list[tuple[str, Fix]] = []
    for proposal in proposals:
        followed = 0
        for fix in proposal.fixes[:COMPOUND_LOOK]:
            if len(found) >= keep or tries[0] <= 0 or followed >= COMPOUND_FOLLOW:
                break
            then = verdict(fix)
            if not isinstance(then, ConfigError) or then.refused and set(then.refused) <= set(fix):
                continue  # refused for another reason than a setting this fix leaves as it was
            tries[0] -= 1
            followed += 1
            more = _next_fix((*then.proposals, *then.alternatives), lambda g, fix=fix: verdict({**fix, **g}),
                             depth, tries)
            if more is not None and {**fix, **more} not in [f for _, f in found]:
                found.append((proposal.lead, {**fix, **more}))
    leads = list(dict.fromkeys(lead for lead, _ in found))
    return tuple((lead, tuple(fix for of, fix in found if of == lead)) for lead in leads)


def _next_fix(proposals: Sequence[Proposal], verdict: Callable[[Fix], ValueError | None], depth: int,
              tries: list[int]) -> Fix | None:
    """The first fix that passes (``verdict`` is None), else, ``depth`` allowing, the first compound."""
    for proposal in proposals:
        for fix in proposal.fixes[:COMPOUND_LOOK]:
            if verdict(fix) is None:
                return fix
    if depth > 1:
        for _, fixes in _compounds(proposals, verdict, depth - 1, tries, 1):
            return fixes[0]
    return None
