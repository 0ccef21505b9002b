"""Replay of what each rank posts, under NCCL's rules: does a step complete, and does every
receive get the message it was meant for? Pure Python; no GPU, no process group.

The runtime is run against a recording transport (:mod:`pipeline_recipes.strategies.harness.recording`) that writes each
rank's program as a list of events; :func:`replay` then runs all programs together:

* every NCCL operation (a batch of sends and receives, or a collective) goes into one FIFO per
  (rank, stream), one stream per process group, and starts once everything before it on that
  stream has completed and the device work it was enqueued after is done;
* the ops of a batch complete together: the batch is done when every send and receive in it has
  met its partner; a receive needs its matching send and a send its matching receive (large
  messages rendezvous), both in batches that have started;
* messages carry no tags: the k-th send from A to B on a group meets B's k-th receive from A on
  that group, and a different message there is reported as a swap;
* a collective completes when every member's k-th collective on that group has started;
* a stream-ordered wait makes every later operation of the rank depend on that operation; a host
  wait stops the rank's host until the operation completed; host headers (gloo, on the host) are
  delivered in order per pair, a receive blocking the host until its send was posted.

A deadlock is reported with each rank's blocked position and the head of every stream.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class P2P:
    """One send (``send`` True) or receive in a batch: ``peer`` is a global rank."""

    send: bool
    peer: int
    message: Hashable


@dataclass(frozen=True)
class Post:
    """The host enqueues an operation on ``stream``: a batch (``ops``) or a collective (``collective``)."""

    op: int  # unique per rank
    stream: Hashable
    ops: tuple[P2P, ...] = ()
    collective: Hashable | None = None
    members: tuple[int, ...] = ()


@dataclass(frozen=True)
class StreamWait:
    """Later device work of this rank runs after operation ``op`` (``Work.wait()`` under NCCL)."""

    op: int


@dataclass(frozen=True)
class HostWait:
    """The host blocks until operation ``op`` completed (``.item()``, a polled wait, gloo)."""

    op: int


@dataclass(frozen=True)
class HostSend:
    peer: int
    message: Hashable


@dataclass(frozen=True)
class HostRecv:
    peer: int
    message: Hashable


Event = Post | StreamWait | HostWait | HostSend | HostRecv


class ReplayError(RuntimeError):
    """The programs deadlock or mismatch messages under NCCL's rules."""


@dataclass
class _Op:
    rank: int
    post: Post
    deps: frozenset[tuple[int, int]]
    done: bool = False
    started: bool = False
    pending: int = 0  # p2p ops not yet matched


@dataclass
class _Rank:
    events: Sequence[Event]
    pc: int = 0
    waited: set[tuple[int, int]] = field(default_factory=set)  # ops the device work now depends on


def replay(programs: Sequence[Sequence[Event]]) -> None:
    """Run every rank's program; raise :class:`ReplayError` on a deadlock or a swapped message."""
    ranks = [_Rank(list(events)) for events in programs]
    ops: dict[tuple[int, int], _Op] = {}
    streams: dict[tuple[int, Hashable], list[_Op]] = defaultdict(list)
    channel: dict[tuple[int, int, Hashable], list[tuple[_Op, int]]] = defaultdict(list)  # (src, dst, stream)
    wanted: dict[tuple[int, int, Hashable], list[tuple[_Op, int]]] = defaultdict(list)
    collectives: dict[Hashable, dict[int, list[_Op]]] = defaultdict(lambda: defaultdict(list))
    headers: dict[tuple[int, int], list[Hashable]] = defaultdict(list)

    def host_step(r: int) -> bool:
        state, moved = ranks[r], False
        while state.pc < len(state.events):
            ev = state.events[state.pc]
            if isinstance(ev, Post):
                op = _Op(r, ev, frozenset(state.waited), pending=len(ev.ops))
                ops[(r, ev.op)] = op
                streams[(r, ev.stream)].append(op)
                for i, p in enumerate(ev.ops):
                    key = (r, p.peer, ev.stream) if p.send else (p.peer, r, ev.stream)
                    (channel if p.send else wanted)[key].append((op, i))
                if ev.collective is not None:
                    collectives[(ev.stream, ev.members)][r].append(op)
            elif isinstance(ev, StreamWait):
                state.waited.add((r, ev.op))
            elif isinstance(ev, HostWait):
                if not ops[(r, ev.op)].done:
                    return moved
            elif isinstance(ev, HostSend):
                headers[(r, ev.peer)].append(ev.message)
            elif isinstance(ev, HostRecv):
                queue = headers[(ev.peer, r)]
                if not queue:
                    return moved
                got = queue.pop(0)
                if got != ev.message:
                    raise ReplayError(f"rank {r} expected header {ev.message} from rank {ev.peer}, got {got}")
            state.pc += 1
            moved = True
        return moved

    heads: dict[tuple[int, Hashable], int] = defaultdict(int)  # first op of each stream not done
    cursor: dict[tuple[int, int, Hashable], int] = defaultdict(int)  # first unmatched pair per channel
    rounds: dict[Hashable, int] = defaultdict(int)  # first incomplete collective per group

    def device_step() -> bool:
        moved = False
        for key, queue in streams.items():  # FIFO per (rank, stream)
            while heads[key] < len(queue) and queue[heads[key]].done:
                heads[key] += 1
            if heads[key] < len(queue):
                op = queue[heads[key]]
                if not op.started and all(ops[d].done for d in op.deps):
                    op.started = moved = True
        for key, sends in channel.items():  # FIFO per (src, dst, stream), no tags
            recvs = wanted.get(key, [])
            while cursor[key] < min(len(sends), len(recvs)):
                (sop, si), (rop, ri) = sends[cursor[key]], recvs[cursor[key]]
                if not (sop.started and rop.started):
                    break  # a later pair cannot overtake this one
                sent, expected = sop.post.ops[si].message, rop.post.ops[ri].message
                if sent != expected:
                    raise ReplayError(
                        f"rank {rop.rank} receives {sent} from rank {sop.rank} where it expects {expected} "
                        f"(messages are matched in order, without tags)"
                    )
                sop.pending -= 1
                rop.pending -= 1
                cursor[key] += 1
                moved = True
        for group, by_rank in collectives.items():
            stream, members = group
            while all(len(by_rank[m]) > rounds[group] for m in members):
                batch = [by_rank[m][rounds[group]] for m in members]
                if not all(o.started for o in batch):
                    break
                names = {o.post.collective for o in batch}
                if len(names) > 1:
                    raise ReplayError(f"collective mismatch on {stream} {members}: {sorted(map(str, names))}")
                for o in batch:
                    o.done = True
                rounds[group] += 1
                moved = True
        for key, queue in streams.items():
            if heads[key] < len(queue):
                op = queue[heads[key]]
                if op.started and not op.done and op.post.collective is None and op.pending == 0:
                    op.done = moved = True
        return moved

    while True:
        moved = any([host_step(r) for r in range(len(ranks))])
        moved = device_step() or moved
        if not moved:
            break
    blocked = [r for r, s in enumerate(ranks) if s.pc < len(s.events)]
    unfinished = [o for o in ops.values() if not o.done]
    if blocked or unfinished:
        lines = [f"rank {r} host blocked at event {ranks[r].pc}: {ranks[r].events[ranks[r].pc]}" for r in blocked]
        for (r, stream), queue in sorted(streams.items(), key=lambda kv: str(kv[0])):
            head = next((o for o in queue if not o.done), None)
            if head is not None:
                what = head.post.collective or " ".join(
                    f"{'send' if p.send else 'recv'}({p.peer}:{p.message})" for p in head.post.ops)
                lines.append(f"rank {r} stream {stream}: {'started' if head.started else 'waiting'} op {head.post.op}: {what}")
        raise ReplayError("deadlock under NCCL's rules:\n" + "\n".join(lines))
