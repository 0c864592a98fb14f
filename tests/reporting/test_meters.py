"""Throughput figures, the data-bound warning and the peak memory of the
training log."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch
from helpers import read_metrics
from torch import nn

from distribuuuu.config import load_cfg
from distribuuuu.engine import evaluation, trainer
from distribuuuu.engine.run_log import format_scaling, throughput, watch_data_time
from distribuuuu.engine.specs import log_spec, strategy_spec
from distribuuuu.logger import setup_logging
from distribuuuu.reporting.meters import DataBoundWatch, PeakMemory
from distribuuuu.strategies.dp import DataParallelStrategy


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
            watch_data_time(log_spec(cfg), run, 0.05, 0.1)
    (record,) = caplog.records
    message = record.getMessage()
    assert "data-bound" in message and "50%" in message
    assert "TRAIN.WORKERS (now 1" in message and "DATA.DECODER" in message


def test_throughput_per_rank_and_scaling_efficiency():
    cfg = load_cfg(None, ["TRAIN.SINGLE_PROCESS_IMG_PER_S", "100"])
    one = throughput(log_spec(cfg), 1, 500, 2.0)
    assert one == {"img_per_s": 250.0, "img_per_s_per_rank": 250.0, "world_size": 1}
    assert format_scaling(one) == ""
    four = throughput(log_spec(cfg), 4, 600, 2.0)  # 300 img/s on 4 x 100: 75%
    assert four["img_per_s_per_rank"] == 75.0
    assert four["scaling_efficiency"] == 0.75
    assert format_scaling(four) == " (75/rank, scaling eff. 75%)"
    unknown = throughput(log_spec(load_cfg()), 2, 600, 2.0)
    assert "scaling_efficiency" not in unknown
    assert format_scaling(unknown) == " (150/rank)"


class _FakeCudaMemory:
    """torch.cuda's peak-memory counters of two GPUs, as the CUDA caching
    allocator keeps them: a peak that only grows until it is reset."""

    def __init__(self, monkeypatch):
        self.peak, self.calls = [0, 0], []
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self.reset)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", self.read)

    def reset(self, device: torch.device) -> None:
        self.calls.append(("reset", device.index))
        self.peak[device.index] = 0

    def read(self, device: torch.device) -> int:
        self.calls.append(("read", device.index))
        return self.peak[device.index]

    def use(self, mib: int) -> None:
        """GPU i holds (i + 1) * ``mib`` MiB for a while."""
        self.peak = [max(p, (i + 1) * mib * 2**20) for i, p in enumerate(self.peak)]


def test_peak_memory_is_reset_and_read_on_every_data_parallel_gpu(monkeypatch):
    cuda = _FakeCudaMemory(monkeypatch)
    model = nn.DataParallel(nn.Linear(2, 2))
    model.device_ids = [0, 1]  # as on a machine with two GPUs

    def model_devices(model, device):
        spec = strategy_spec(load_cfg(), device)
        return DataParallelStrategy(spec).devices(model)

    devices = model_devices(model, torch.device("cuda", 0))
    assert devices == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert model_devices(nn.Linear(2, 2), torch.device("cuda", 1)) == devices[1:]
    memory = PeakMemory(devices)
    cuda.use(300)
    memory.reset()
    cuda.use(100)
    assert memory.read() == [100.0, 200.0]
    assert cuda.calls == [("reset", 0), ("reset", 1), ("read", 0), ("read", 1)]
    cpu = PeakMemory([torch.device("cpu")])
    cpu.reset()  # the peak resident set size cannot be reset: nothing to do
    assert len(cuda.calls) == 4 and cpu.read()[0] > 0


def test_each_epoch_logs_the_peaks_of_its_training_and_evaluation(
    monkeypatch, tmp_path
):
    """A run on two (fake) GPUs: training epoch e holds 100/e MiB on the first
    and twice that on the second, each evaluation 10 MiB and 20 MiB."""
    cuda = _FakeCudaMemory(monkeypatch)
    gpus = [torch.device("cuda", 0), torch.device("cuda", 1)]
    # The peaks of the two GPUs, whatever devices the run is on.
    for module in (trainer, evaluation):
        monkeypatch.setattr(module, "PeakMemory", lambda devices: PeakMemory(gpus))
    train_epoch, evaluate = trainer.train_epoch, evaluation.evaluate
    epochs = []

    def train_epoch_on_gpus(run, *args, **kwargs):
        epochs.append(run.progress.epoch)
        cuda.use(100 // len(epochs))
        return train_epoch(run, *args, **kwargs)

    def evaluate_on_gpus(*args, **kwargs):
        cuda.use(10)
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(trainer, "train_epoch", train_epoch_on_gpus)
    monkeypatch.setattr(evaluation, "evaluate", evaluate_on_gpus)
    recipe = [
        "MODEL.ARCH",
        "lenet5",
        "MODEL.DUMMY_INPUT",
        "True",
        "DATA.SYNTHETIC_SIZE",
        "[16,8]",
        "TRAIN.IM_SIZE",
        "28",
        "TEST.IM_SIZE",
        "28",
        "TRAIN.BATCH_SIZE",
        "8",
        "OPTIM.MAX_EPOCH",
        "2",
        "MODEL.EMA",
        "True",
    ]
    try:
        trainer.train_model(load_cfg(None, [*recipe, "OUT_DIR", str(tmp_path)]))
    finally:
        setup_logging(None, 1)  # close the log file, leave no handler behind
    val, val_ema = (
        read_metrics(str(tmp_path), "val"),
        read_metrics(str(tmp_path), "val_ema"),
    )
    assert [r["train_peak_mem_mb"] for r in val] == [[100, 200], [50, 100]]
    assert [r["train_peak_mem_mb"] for r in val_ema] == [[100, 200], [50, 100]]
    assert all(r["eval_peak_mem_mb"] == [10, 20] for r in val + val_ema)
    assert [r["peak_mem_mb"] for r in val] == [[100, 200], [50, 100]]
    # Every phase starts with a reset of both GPUs and ends reading both.
    phase = [("reset", 0), ("reset", 1), ("read", 0), ("read", 1)]
    assert cuda.calls == phase * 6  # 2 epochs x (training, evaluation, EMA's)
