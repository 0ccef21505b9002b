"""Per-pair message order of every schedule: what NCCL's in-order p2p matching needs."""

from __future__ import annotations

import pytest

from strategies.schedules import build_schedule
from strategies.schedules.messages import Message, fifo_violations, pair_messages

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


@pytest.mark.parametrize("name, D, N, concat", [c for c in CASES if not (c[3] == "backward_halving" and c[1] >= 8)])
def test_sends_arrive_in_the_order_they_are_consumed(name: str, D: int, N: int, concat: str) -> None:
    """Safe for NCCL (in-order matching per pair) without relying on tags."""
    assert fifo_violations(build_schedule(name, D, N, None, concat)) == []


def test_backward_halving_at_d8_reorders_messages() -> None:
    """Known: two gradient halves cross on a pair; on NCCL the engine refuses this schedule."""
    assert fifo_violations(build_schedule("chimera", 8, 16, None, "backward_halving")) == [(1, 2), (6, 5)]
