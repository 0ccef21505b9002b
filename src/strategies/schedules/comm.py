"""Point-to-point communication of a schedule in rounds: what each worker sends and receives, when.

The schedule fixes each worker's action order; this module derives, as plain data, the messages
that go out around each action. Before action ``i`` a worker posts one *round*: the messages
action ``i - 1`` produced and the messages action ``i`` needs, issued together (one
``dist.batch_isend_irecv``, as torch.distributed.pipelining and Megatron do); after its last
action, a final round with that action's sends. Grouping a send with the receive that the peer
posts in its own matching round lets NCCL complete both at once: two peers that send to each other
at the same boundary (1F1B's steady state, Chimera's crossing directions) cannot block each other,
and no receive is posted ahead of the sends its peer waits for.

NCCL ignores tags and matches each ordered pair's messages first in, first out. A worker therefore
receives a peer's messages exactly in the order the peer sends them: when an action needs message
``m`` from peer ``u``, the round also receives every earlier message ``u`` sends it that has not
arrived yet (kept until its action runs; Chimera's backward halving sends two gradient halves in
another order than they are consumed).

An asynchronous window (PipeDream, PipeDream-2BW) ends with the messages sent to the worker in
this window but consumed in the next one: they arrive in the window that sends them, so no
receive waits across a step boundary (in front of the step's collectives). The next window's plan
is told which messages are already in (``carried_in``).

Whether a plan is safe under NCCL's rules is checked by replaying what the runtime really posts
(:mod:`pipeline_recipes.strategies.harness.nccl_replay`), not by this module.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from pipeline_recipes.strategies.schedules.actions import Action, Schedule
from pipeline_recipes.strategies.schedules.graph import dependencies, index_actions
from pipeline_recipes.strategies.schedules.messages import Message, is_local, received_messages, sent_messages
from pipeline_recipes.strategies.schedules.simulate import action_cost


@dataclass(frozen=True)
class Transfer:
    """One message to (send) or from (receive) another worker of the same pipeline group."""

    peer: int
    message: Message

    def __str__(self) -> str:
        m = self.message
        half = "" if m.half is None else f"h{m.half}"
        return f"{m.kind}{m.stage}:{m.mb}{half}p{m.pipe}@w{self.peer}"


@dataclass(frozen=True)
class Round:
    """Sends and receives posted together; ``recvs`` in the order they are matched per peer."""

    sends: tuple[Transfer, ...] = ()
    recvs: tuple[Transfer, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.sends or self.recvs)

    def shifted(self, offset: int) -> Round:
        """The same round with every micro-batch index moved by ``offset``."""
        return Round(tuple(Transfer(t.peer, shifted_message(t.message, offset)) for t in self.sends),
                     tuple(Transfer(t.peer, shifted_message(t.message, offset)) for t in self.recvs))


@dataclass(frozen=True)
class CommPlan:
    """``rounds[i]`` goes out before ``actions[i]``; ``rounds[-1]`` after the last action."""

    worker: int
    stages: int
    actions: tuple[Action, ...]
    rounds: tuple[Round, ...]

    def needs(self, i: int) -> tuple[Message, ...]:
        """The messages action ``i`` consumes (local ones included), in the order it uses them."""
        return tuple(m for _, m in received_messages(self.actions[i], self.stages))

    def shifted(self, offset: int) -> CommPlan:
        """The same plan with every micro-batch index moved by ``offset``: an asynchronous schedule's
        later windows are its steady window renumbered, and so are their plans."""
        if offset == 0:
            return self
        actions = tuple(replace(a, mbs=tuple(m + offset for m in a.mbs)) for a in self.actions)
        return CommPlan(self.worker, self.stages, actions, tuple(r.shifted(offset) for r in self.rounds))


def shifted_message(message: Message, offset: int) -> Message:
    """``message`` of the micro-batch ``offset`` later."""
    return message._replace(mb=message.mb + offset)


def _routes(schedule: Schedule, action: Action, produced: bool) -> list[Transfer]:
    """(peer worker, message) for every message ``action`` sends (or, if not ``produced``, receives)
    to or from another worker; local messages (consecutive stages on one worker) need no transfer."""
    pairs = sent_messages(action, schedule.stages) if produced else received_messages(action, schedule.stages)
    return [Transfer(schedule.worker_of(action.pipe, stage), msg) for stage, msg in pairs
            if not is_local(schedule, msg)]


def executed_actions(schedule: Schedule, worker: int, train: bool = True) -> tuple[Action, ...]:
    """What ``worker`` runs: all its actions in training, its forwards in evaluation."""
    return tuple(a for a in schedule.workers[worker] if train or a.kind == "F")


def unconsumed_messages(schedule: Schedule, worker: int) -> frozenset[Message]:
    """Messages sent to ``worker`` in ``schedule`` (an asynchronous window) that it does not consume there."""
    consumed = {m for a in schedule.workers[worker] for _, m in received_messages(a, schedule.stages)}
    return frozenset(t.message for w, acts in enumerate(schedule.workers) if w != worker
                     for a in acts for t in _routes(schedule, a, True) if t.peer == worker and t.message not in consumed)


def _timeline(schedule: Schedule, train: bool) -> dict[Action, float]:
    """End time of every executed action, as soon as possible at t_b = 2 t_f (Chimera §3.4). A
    dependency outside ``schedule`` (an earlier window's) counts as done at time 0."""
    workers = [executed_actions(schedule, w, train) for w in range(schedule.num_workers)]
    present = {a for acts in workers for a in acts}
    known = index_actions(present)
    t_f, t_b = [1.0] * schedule.stages, [2.0] * schedule.stages
    end: dict[Action, float] = {}
    free = [0.0] * len(workers)
    position = [0] * len(workers)
    progressed = True
    while progressed:
        progressed = False
        for w, acts in enumerate(workers):
            while position[w] < len(acts):
                a = acts[position[w]]
                deps = [d for d in dependencies(a, known, schedule.stages) if d in present]
                if any(d not in end for d in deps):
                    break
                start = max([end[d] for d in deps] + [free[w]])
                end[a] = free[w] = start + action_cost(a, t_f, t_b)
                position[w] += 1
                progressed = True
    if any(p < len(acts) for p, acts in zip(position, workers)):
        raise ValueError(f"schedule '{schedule.name}' deadlocks: validate it first")
    return end


def comm_plan(schedule: Schedule, worker: int, train: bool = True,
              carried_in: Iterable[Message] = ()) -> CommPlan:
    """The rounds ``worker`` posts around its actions (training: all actions; evaluation: forwards).

    A message is received in the round its consumer needs it, or earlier: in the first round that
    goes out once its sender has posted it (on the as-soon-as-possible timeline), so that a send
    and its receive usually meet in rounds posted at the same moment. Receiving early is what
    keeps two peers that each send before receiving from blocking each other.
    """
    return _plan(schedule, worker, train, carried_in, _timeline(schedule, train))


def _plan(schedule: Schedule, worker: int, train: bool, carried_in: Iterable[Message],
          end: dict[Action, float]) -> CommPlan:
    """:func:`comm_plan` on the timeline ``end`` of the whole schedule (the same for every worker)."""
    actions = executed_actions(schedule, worker, train)
    post_time = [0.0] + [end[a] for a in actions]  # round i goes out when action i - 1 ends
    incoming: dict[int, list[tuple[Message, float]]] = defaultdict(list)  # peer → (message, sent at), its order
    for peer in range(schedule.num_workers):
        if peer != worker:
            for a in executed_actions(schedule, peer, train):
                incoming[peer] += [(t.message, end[a]) for t in _routes(schedule, a, True) if t.peer == worker]
    consumer = {m: i for i, a in enumerate(actions) for t in _routes(schedule, a, False) for m in [t.message]}
    round_of: dict[Message, int] = {}
    for peer, queue in incoming.items():
        later = len(actions)  # per peer, receives go in send order: never after a later-sent message's
        for message, sent_at in reversed(queue):
            if message in carried_in:
                continue
            first_after = next((i for i, t in enumerate(post_time) if t >= sent_at), len(actions))
            round_of[message] = later = min(first_after, consumer.get(message, len(actions)), later)
    missing = [m for m in consumer if m not in round_of and m not in carried_in]
    if missing:
        raise ValueError(f"worker {worker} needs {missing[0]}, which no worker sends it")
    recvs: list[list[Transfer]] = [[] for _ in range(len(actions) + 1)]
    for peer in sorted(incoming):
        for message, _ in incoming[peer]:
            if message in round_of:
                recvs[round_of[message]].append(Transfer(peer, message))
    rounds = []
    previous_sends: tuple[Transfer, ...] = ()
    for i, action in enumerate(actions):
        rounds.append(Round(previous_sends, tuple(recvs[i])))
        previous_sends = tuple(_routes(schedule, action, True))
    rounds.append(Round(previous_sends, tuple(recvs[-1])))
    return CommPlan(worker, schedule.stages, actions, tuple(rounds))


def format_rounds(plan: CommPlan) -> str:
    """One line per round: the sends and receives, then the action that follows."""
    lines = []
    for i, rnd in enumerate(plan.rounds):
        after = str(plan.actions[i]) if i < len(plan.actions) else "(end)"
        sends = " ".join(f"send {t}" for t in rnd.sends)
        recvs = " ".join(f"recv {t}" for t in rnd.recvs)
        lines.append(f"{i:3d}: {sends} {recvs} -> {after}".replace("  ", " "))
    return "\n".join(lines)


def plans(schedule: Schedule, train: bool = True) -> Sequence[CommPlan]:
    """Every worker's plan (a synchronous step)."""
    end = _timeline(schedule, train)
    return [_plan(schedule, w, train, (), end) for w in range(schedule.num_workers)]
