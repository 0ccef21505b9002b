"""The checkpoint writer (foreground and background saves, one in flight, failures raised, work after a save) and
DCP's chunks of a flattened range, in-process."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import pytest
import torch

from pipeline_recipes.strategies.checkpoint_writer import CheckpointWriter, staged
from pipeline_recipes.strategies.dcp_state import FlatPiece, flat_range_boxes


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1, 3), ()])
def test_the_chunks_of_a_flat_range_are_exactly_its_elements_in_order(shape: tuple[int, ...]) -> None:
    numel = math.prod(shape)
    tensor = torch.arange(numel).reshape(shape)
    for start in range(numel + 1):
        for stop in range(start, numel + 1):
            boxes = flat_range_boxes(shape, start, stop)
            got = [v for offsets, sizes in boxes
                   for v in tensor[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1).tolist()]
            assert got == list(range(start, stop)), (shape, start, stop, boxes)  # brute force: index every element
            assert len(boxes) <= max(1, 2 * len(shape) - 1)


def test_a_piece_views_its_chunks_in_its_own_flat_tensor() -> None:
    flat = torch.arange(5.0)
    piece = FlatPiece((3, 4), 3, flat)  # elements 3..7 of a 3 × 4 tensor: row 0's last, row 1 whole
    assert [(o, tuple(v.shape)) for (o, _), v in piece.boxes()] == [((0, 3), (1, 1)), ((1, 0), (1, 4))]
    piece.box_at((1, 0)).fill_(-1)
    assert flat.tolist() == [0.0, -1.0, -1.0, -1.0, -1.0]


def test_staging_copies_every_tensor() -> None:
    weight, moment = torch.ones(3), torch.zeros(4)
    copy = staged({"w": weight, "m": FlatPiece((8,), 4, moment), "lr": 0.1})
    weight.add_(1), moment.add_(1)
    assert copy["w"].tolist() == [1.0] * 3 and copy["m"].flat.tolist() == [0.0] * 4 and copy["lr"] == 0.1


def _slow_save(tmp_path: Path, release: threading.Event, name: str = "a"):
    def write() -> Path:
        if not release.wait(10):
            raise TimeoutError("not released")
        (tmp_path / name).write_bytes(b"x" * 10)
        return tmp_path / name
    return write


def test_a_background_save_returns_at_once_and_one_at_a_time(tmp_path: Path) -> None:
    writer, release, done = CheckpointWriter(background=True, timeout_s=10), threading.Event(), []
    writer.save(1, tmp_path / "a", _slow_save(tmp_path, release), time.perf_counter())
    assert writer.in_flight() and writer.saves[0].write_s is None
    assert writer.after_save(done.append)  # put off until the save is complete
    threading.Timer(0.2, release.set).start()
    writer.wait()  # the next save, a stop and the end of training wait here
    assert done == [tmp_path / "a"] and not writer.in_flight()
    record = writer.saves[0]
    assert record.blocking_s < 0.1 <= record.write_s and record.bytes == 10 and record.step == 1
    assert writer.after_save(done.append) and done == [tmp_path / "a"] * 2  # written: the work runs at once
    writer.close()
    assert not CheckpointWriter().after_save(done.append)  # foreground saves: the caller does the work


def test_a_failed_background_save_is_raised_at_the_next_step_and_skips_the_work_after_it(tmp_path: Path) -> None:
    writer, done = CheckpointWriter(background=True, timeout_s=10), []

    def full_disk() -> Path:
        raise OSError(28, "No space left on device")

    writer.save(2, tmp_path / "b", full_disk, time.perf_counter())
    writer.after_save(done.append)
    deadline = time.monotonic() + 10
    with pytest.raises(OSError, match="No space left"):
        while time.monotonic() < deadline:
            writer.raise_if_failed()
            time.sleep(0.01)
    assert writer.after_save(done.append) and done == []  # never after a failed save
    writer.close()


def test_a_save_that_does_not_finish_in_time_is_said(tmp_path: Path) -> None:
    writer, release = CheckpointWriter(background=True, timeout_s=0.2), threading.Event()
    writer.save(3, tmp_path / "c", _slow_save(tmp_path, release, "c"), time.perf_counter())
    with pytest.raises(TimeoutError, match="did not finish within 0 s"):
        writer.wait()
    release.set()


def test_a_foreground_save_is_written_before_it_returns(tmp_path: Path) -> None:
    writer, release = CheckpointWriter(), threading.Event()
    release.set()
    writer.save(4, tmp_path / "d", _slow_save(tmp_path, release, "d"), time.perf_counter())
    record = writer.saves[0]
    assert (tmp_path / "d").exists() and record.write_s is not None and record.blocking_s >= record.write_s
