"""The slow-rank report: which rank it names, how the compute is timed, and a
2-rank run where one rank's loader sleeps."""

from __future__ import annotations

import os
import time

import pytest
import torch
from helpers import TINY, import_train_net, run_launched

from distribuuuu.data.datasets import SyntheticDataset
from distribuuuu.dist import group as du
from distribuuuu.engine.loop import StopRequest
from distribuuuu.reporting.stragglers import (
    COMPUTE,
    DATA,
    ComputeClock,
    SlowRankWatch,
    slow_rank,
)

MS = 1e-3


def named(rows: list[list[float]], ratio: float = 1.3) -> tuple | None:
    """(rank, cause) of the slow rank of ``rows`` (ms), or None."""
    found = slow_rank([[MS * value for value in row] for row in rows], ratio)
    return found and (found.rank, found.cause)


def test_the_rank_that_waits_for_data_is_named_not_those_that_wait_for_it():
    # Rank 1 waits 60 ms for data; rank 0 waits for rank 1 inside its compute.
    rows = [[1 * MS, 70 * MS], [60 * MS, 10 * MS]]
    found = slow_rank(rows, 1.3)
    assert found and (found.rank, found.cause) == (1, DATA)
    # Alone it would take 60 + 10 ms; the median rank 30.5 + 10 ms.
    assert (found.step, found.median_step) == pytest.approx((70 * MS, 40.5 * MS))
    assert (found.part, found.median_part) == pytest.approx((60 * MS, 30.5 * MS))
    assert named([[1, 70]] * 3 + [[60, 10]] + [[1, 70]] * 4) == (3, DATA)


def test_a_loader_as_slow_as_the_compute_is_named_among_2_ranks():
    # Rank 1 waits 12 ms for data, about as long as a step computes: 22 ms
    # alone, against the median rank's (2 + 12) / 2 + 10 = 17 ms: 1.29 x.
    assert named([[2, 22], [12, 10]], 1.3) is None
    assert named([[2, 22], [12, 10]], 1.2) == (1, DATA)


def test_ranks_alike_or_a_small_difference_name_none():
    assert named([[2, 20]] * 4) is None
    # 4 ms more data wait than the median, in steps of about 20 ms.
    assert named([[2, 20], [6, 16], [2, 20]]) is None


def test_compute_is_named_where_the_whole_step_is_longer():
    found = slow_rank([[1 * MS, 20 * MS], [1 * MS, 40 * MS], [1 * MS, 20 * MS]], 1.3)
    assert found and (found.rank, found.cause) == (1, COMPUTE)
    assert (found.part, found.median_part) == pytest.approx((40 * MS, 20 * MS))
    # A majority that waited for data: the fast rank's compute (its wait for
    # them) is no slow compute, and the median rank is no slow rank.
    assert named([[0, 40], [20, 20], [20, 20]]) is None
    assert named([[50, 10], [50, 10], [0, 60]]) is None


def test_the_watch_names_a_rank_and_cause_once_and_ratio_0_is_off():
    watch = SlowRankWatch()
    assert watch.take() is None
    watch.hold(0.5, 0.25)
    assert watch.take() == (0.5, 0.25) and watch.take() is None
    slow = [[1 * MS, 70 * MS], [60 * MS, 10 * MS]]
    watch.rows = slow
    assert watch.update(0) is None  # off
    watch.rows = slow
    found = watch.update(1.3)
    assert found and (found.rank, found.cause) == (1, DATA)
    watch.rows = slow
    assert watch.update(1.3) is None  # named already
    assert watch.update(1.3) is None  # nothing carried since


class _FakeEvent:
    """A CUDA timing event that counts what a step asks of the device."""

    log: list[str] = []
    clock = 0.0

    def __init__(self):
        self.at = None

    def record(self):
        _FakeEvent.clock += 0.010  # the device runs 10 ms between records
        self.at = _FakeEvent.clock
        self.log.append("record")

    def synchronize(self):
        self.log.append("synchronize")

    def elapsed_time(self, end) -> float:
        self.log.append("elapsed_time")
        return 1000 * (end.at - self.at)


def test_cuda_compute_events_are_read_only_when_reported(monkeypatch):
    monkeypatch.setattr(_FakeEvent, "log", [])
    clock = ComputeClock(torch.device("cuda"), event=_FakeEvent)
    for _ in range(3):
        clock.start()
        clock.stop(waited=0.004)  # 4 ms of the step waited for a later batch
    assert _FakeEvent.log == ["record"] * 6  # no synchronization while training
    assert clock.read() == pytest.approx(3 * 0.006)
    assert _FakeEvent.log[6:] == ["synchronize"] + ["elapsed_time"] * 3
    assert clock.read() == 0.0  # read afresh


def test_cpu_compute_is_the_host_time_less_the_later_waits():
    clock = ComputeClock(torch.device("cpu"))
    clock.start()
    time.sleep(0.02)
    clock.stop(waited=0.015)
    clock.stop()  # no step begun: nothing counted
    assert 0.004 < clock.read() < 0.5


def test_ordinary_checks_reduce_8_bytes_and_the_first_after_a_print_carries(
    monkeypatch,
):
    calls = []
    monkeypatch.setattr(du, "is_distributed", lambda: True)
    monkeypatch.setattr(du, "all_reduce_max_int", lambda v: calls.append(v) or 0)

    def with_rows(value, row):
        calls.append((value, tuple(row)))
        return 0, [list(row), [0.2, 0.1]]

    monkeypatch.setattr(du, "all_reduce_max_int_with_rows", with_rows)
    stop, watch = StopRequest(every=2), SlowRankWatch()
    try:
        watch.hold(0.01, 0.02)  # a print step
        assert stop.agreed(1, watch) == 0  # no check at this step
        stop.agreed(2, watch)
        stop.agreed(4, watch)
        stop.agreed(None, watch)
    finally:
        stop.restore()
    assert calls == [(0, (0.01, 0.02)), 0, 0]
    assert watch.rows == [[0.01, 0.02], [0.2, 0.1]]


# Seconds rank 1's loader sleeps per image: 96 ms per batch of 32, well beyond
# LeNet's step on a CPU core.
DELAY = 0.003


def _train_with_rank_1_loading_slowly(out_dir: str) -> None:
    """tools/train_net.py's main on this rank of a launched job; rank 1's
    synthetic images take DELAY seconds each."""
    if os.environ["RANK"] == "1":
        make = SyntheticDataset.__getitem__

        def slow(self, index):
            time.sleep(DELAY)
            return make(self, index)

        SyntheticDataset.__getitem__ = slow  # type: ignore[method-assign]
    args = [*TINY, "OUT_DIR", out_dir, "DIST.STOP_CHECK_STEPS", "3"]
    code = import_train_net().main(args)
    torch.save(code, os.path.join(out_dir, f"exit{os.environ['RANK']}.pt"))


@pytest.mark.slow
@pytest.mark.distributed
def test_a_rank_whose_loader_sleeps_is_named_in_the_log(tmp_path):
    # 4 steps, printed after 2 and 4; stop checks after step 3 (carrying the
    # first window) and at the epoch's end (carrying the second).
    out = str(tmp_path / "out")
    os.makedirs(out)
    run_launched(2, _train_with_rank_1_loading_slowly, (out,))
    for rank in (0, 1):
        assert torch.load(os.path.join(out, f"exit{rank}.pt")) == 0
    with open(os.path.join(out, "log.txt"), encoding="utf-8") as log:
        warnings = [line for line in log if "slow rank" in line]
    assert len(warnings) == 1, warnings  # named once
    assert "slow rank: rank 1 of 2 takes" in warnings[0]
    assert "its wait for data is slow" in warnings[0]
