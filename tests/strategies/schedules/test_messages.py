"""Messages between workers and the rounds they travel in (strategies.schedules.messages, .comm)."""

from __future__ import annotations

import pytest

from pipeline_recipes.strategies.schedules import build_schedule
from pipeline_recipes.strategies.schedules.comm import Transfer, plans
from pipeline_recipes.strategies.schedules.messages import Message, fifo_violations, pair_messages

CASES = [(name, D, N, concat)
         for name in ("gpipe", "dapple", "chimera") for D in (2, 4, 6, 8) for N in (max(D // 2, 1), D, 2 * D, 2 * D + 1)
         for concat in (("direct", "forward_doubling", "backward_halving") if name == "chimera" else ("direct",))]


def test_dapple_pair_messages_at_d2() -> None:
    sends, receives = pair_messages(build_schedule("dapple", 2, 2))
    assert sends[(0, 1)] == [Message("act", 0, 0, 0), Message("act", 0, 0, 1)]
    assert sends[(1, 0)] == [Message("grad", 0, 1, 0), Message("grad", 0, 1, 1)]
    assert receives == sends


@pytest.mark.parametrize("name, D, N, concat", CASES)
def test_every_message_is_sent_once_and_received_once(name: str, D: int, N: int, concat: str) -> None:
    sends, receives = pair_messages(build_schedule(name, D, N, None, concat))
    for pair in set(sends) | set(receives):
        assert sorted(sends.get(pair, [])) == sorted(receives.get(pair, [])), pair


@pytest.mark.parametrize("name, D, N, concat", [c for c in CASES if not (c[3] == "backward_halving" and c[1] >= 8)
                                                 and not (c[0] == "chimera" and c[3] == "direct" and c[2] > c[1])])
def test_sends_arrive_in_the_order_they_are_consumed(name: str, D: int, N: int, concat: str) -> None:
    """Safe for NCCL (in-order matching per pair) without relying on tags. Chimera's direct
    concatenation for N > D is list-scheduled in time and receives some messages out of send order
    (the rounds receive them in send order: test_rounds_... below)."""
    assert fifo_violations(build_schedule(name, D, N, None, concat)) == []


def test_backward_halving_at_d8_reorders_messages() -> None:
    """Two gradient halves cross on a pair: the rounds receive them in the order they are sent."""
    assert fifo_violations(build_schedule("chimera", 8, 16, None, "backward_halving")) == [(1, 2), (6, 5)]


def test_dapple_rounds_at_d2_by_hand() -> None:
    """DAPPLE, D = 2, N = 2 at t_b = 2 t_f: worker 1 receives activation 1 before its first backward
    (worker 0 sends it then, together with its receive of gradient 0), the rest when needed."""
    act = lambda mb: Message("act", 0, 0, mb)  # noqa: E731
    grad = lambda mb: Message("grad", 0, 1, mb)  # noqa: E731
    w0, w1 = plans(build_schedule("dapple", 2, 2))
    assert [(r.sends, r.recvs) for r in w0.rounds] == [
        ((), ()), ((Transfer(1, act(0)),), ()), ((Transfer(1, act(1)),), (Transfer(1, grad(0)),)),
        ((), (Transfer(1, grad(1)),)), ((), ())]
    assert [(r.sends, r.recvs) for r in w1.rounds] == [
        ((), (Transfer(0, act(0)),)), ((), (Transfer(0, act(1)),)), ((Transfer(0, grad(0)),), ()), ((), ()),
        ((Transfer(0, grad(1)),), ())]


@pytest.mark.parametrize("name, D, N, concat", CASES)
@pytest.mark.parametrize("train", [True, False])
def test_rounds_send_after_producing_and_receive_in_send_order_before_use(name: str, D: int, N: int, concat: str,
                                                                          train: bool) -> None:
    schedule = build_schedule(name, D, N, None, concat)
    worker_plans = plans(schedule, train)
    sends, receives = pair_messages(schedule)
    for plan in worker_plans:
        got: dict[int, list[Message]] = {}
        for i, rnd in enumerate(plan.rounds):
            assert i > 0 or not rnd.sends
            for t in rnd.sends:  # sent right after the action that produced it
                assert t.message.stage == plan.actions[i - 1].stage and t.message.mb in plan.actions[i - 1].mbs
            for t in rnd.recvs:
                got.setdefault(t.peer, []).append(t.message)
            if i < len(plan.actions):  # every input is in by the round before its action
                arrived = {m for ms in got.values() for m in ms}
                assert set(plan.needs(i)) <= arrived, (plan.worker, plan.actions[i])
        for peer, messages in got.items():  # per pair, in the sender's order (NCCL matches without tags)
            expected = [m for m in sends.get((peer, plan.worker), []) if train or m.kind == "act"]
            assert messages == expected, (peer, plan.worker)
