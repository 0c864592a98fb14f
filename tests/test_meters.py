"""Throughput figures and the data-bound warning of the training log."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from distribuuuu.config import load_cfg
from distribuuuu.meters import DataBoundWatch
from distribuuuu.trainer import _format_scaling, _throughput, _watch_data_time


def test_data_bound_watch_trips_once_after_windows_in_a_row():
    watch = DataBoundWatch(windows=3)
    # 40% of the step waiting for data, above a 20% share: slow windows.
    slow, fast = (0.4, 1.0, 0.2), (0.1, 1.0, 0.2)
    assert [watch.update(*w) for w in (slow, slow, fast, slow, slow)] == [False] * 5
    assert watch.update(*slow) is True  # the third slow window in a row
    assert [watch.update(*slow) for _ in range(5)] == [False] * 5  # only once


def test_data_bound_watch_is_off_at_share_zero():
    watch = DataBoundWatch(windows=1)
    assert not any(watch.update(0.9, 1.0, 0.0) for _ in range(5))


def test_rank0_warns_with_the_knobs_to_turn(caplog):
    cfg = load_cfg(None, ["TRAIN.WORKERS", "1", "TRAIN.DATA_BOUND_SHARE", "0.3"])
    run = SimpleNamespace(data_watch=DataBoundWatch())
    with caplog.at_level(logging.WARNING, logger="distribuuuu"):
        for _ in range(6):
            _watch_data_time(cfg, run, 0.05, 0.1)
    (record,) = caplog.records
    message = record.getMessage()
    assert "data-bound" in message and "50%" in message
    assert "TRAIN.WORKERS (now 1" in message and "DATA.DECODER" in message


def test_throughput_per_rank_and_scaling_efficiency():
    cfg = load_cfg(None, ["TRAIN.SINGLE_PROCESS_IMG_PER_S", "100"])
    one = _throughput(cfg, 1, 500, 2.0)
    assert one == {"img_per_s": 250.0, "img_per_s_per_rank": 250.0, "world_size": 1}
    assert _format_scaling(one) == ""
    four = _throughput(cfg, 4, 600, 2.0)  # 300 img/s on 4 x 100: 75%
    assert four["img_per_s_per_rank"] == 75.0
    assert four["scaling_efficiency"] == 0.75
    assert _format_scaling(four) == " (75/rank, scaling eff. 75%)"
    unknown = _throughput(load_cfg(), 2, 600, 2.0)
    assert "scaling_efficiency" not in unknown
    assert _format_scaling(unknown) == " (150/rank)"
