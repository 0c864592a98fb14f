"""``DIST.STRATEGY auto``: plan on the machine in hand at start-up, run the
chosen strategy, and check the plan against the run.

The steps, after the process group is joined (:func:`resolve`):

1. every rank measures its device and the links (:func:`calibrate`, a
   collective of about a second);
2. rank 0 weighs the candidates in a process of its own: the memory traces
   run on the fake process group, which a process that joined a real one
   cannot host; the others wait for its answer;
3. every rank writes the chosen plan into its config (``DIST.STRATEGY``,
   ``TRAIN.BATCH_SIZE``, ``TRAIN.ACCUM_STEPS``, ``MODEL.ACT_CKPT`` and the
   chosen strategy's degrees), so that config.yaml records it and a rerun
   with that file reproduces it.  Rank 0 keeps it in ``OUT_DIR/plan.json``:
   a resumed or requeued run takes it from there and never plans again,
   since the checkpoint's layout depends on it.

After the first steps :class:`PlanCheck` logs ``predicted peak X MiB,
measured Y MiB`` with the step time's prediction beside the measured one.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import multiprocessing
import os
import statistics
import time
from typing import Any

import torch
from torch import nn
from yacs.config import CfgNode

from distribuuuu import checkpoint as cp
from distribuuuu.config.loading import merge_resolved
from distribuuuu.config.validation import largest_train_size
from distribuuuu.dist import group as du
from distribuuuu.engine.specs import AUTO_STRATEGY, model_spec
from distribuuuu.errors import ConfigError
from distribuuuu.fileio import atomic_write, read_small_file
from distribuuuu.models import build_configured
from distribuuuu.plan.calibrate import Calibration, calibrate
from distribuuuu.plan.candidate import OFFLOAD_ALL, OFFLOAD_NONE, Candidate
from distribuuuu.plan.memory import MIB
from distribuuuu.plan.paper import PaperMachine, PaperRun
from distribuuuu.plan.search import NothingFitsError, PlanResult, format_table
from distribuuuu.plan.tracing import PeakTracker

logger = logging.getLogger(__name__)

RECORD = "plan.json"
MAX_RECORD_BYTES = 1 << 20
# A prediction further than this from the measurement is warned about.
WARN_OFF_BY = 0.20


def overrides(candidate: Candidate) -> dict[str, Any]:
    """The config keys that run ``candidate`` (its strategy's degrees; the
    keys of the strategies it does not use keep their values)."""
    keys: dict[str, Any] = {
        "DIST.STRATEGY": candidate.strategy,
        "DIST.TENSOR_PARALLEL": candidate.tensor_parallel or 1,
        "TRAIN.BATCH_SIZE": candidate.micro_batch,
        "TRAIN.ACCUM_STEPS": candidate.accum_steps,
        "MODEL.ACT_CKPT": candidate.act_ckpt,
    }
    if candidate.pipeline_stages is not None:
        keys["DIST.PIPELINE.STAGES"] = candidate.pipeline_stages
        keys["DIST.PIPELINE.SCHEDULE"] = candidate.pipeline_schedule
    if candidate.shard_size is not None:
        keys["DIST.HSDP.SHARD_SIZE"] = candidate.shard_size
    if candidate.zero_stage is not None:
        offload = candidate.offload or OFFLOAD_NONE
        keys["DIST.DEEPSPEED.ZERO_STAGE"] = candidate.zero_stage
        keys["DIST.DEEPSPEED.OFFLOAD_OPTIMIZER"] = (
            "none" if offload == OFFLOAD_NONE else "cpu"
        )
        keys["DIST.DEEPSPEED.OFFLOAD_PARAMS"] = (
            "cpu" if offload == OFFLOAD_ALL else "none"
        )
        keys["DIST.DEEPSPEED.CONFIG"] = ""
    return keys


# What a recorded plan may set: the keys overrides() writes for a candidate
# that uses every degree.
RECORDED_KEYS = frozenset(
    overrides(
        Candidate(
            strategy="deepspeed",
            tensor_parallel=2,
            pipeline_stages=2,
            pipeline_schedule="1f1b",
            data_parallel=1,
            shard_size=2,
            zero_stage=3,
            offload=OFFLOAD_ALL,
            micro_batch=1,
            accum_steps=1,
            act_ckpt=True,
        )
    )
)


@dataclasses.dataclass(frozen=True)
class Planned:
    """The plan a run follows: the keys it set, what it predicts, and (when
    it was made now rather than reused) the whole search."""

    keys: dict[str, Any]
    why: str
    memory_mib: float | None
    step_s: float | None
    result: dict | None = None  # PlanResult.as_dict(); None when reused
    table: str = ""
    peak_flops: float | None = None  # the device's, when calibrated now

    def record(self) -> dict:
        """The object of ``plan.json`` (and of the metrics' plan line)."""
        return {
            "keys": self.keys,
            "why": self.why,
            "memory_mib": self.memory_mib,
            "step_s": self.step_s,
            **(self.result or {}),
        }


def _of_result(result: PlanResult) -> Planned:
    chosen = result.chosen
    return Planned(
        keys=overrides(chosen.candidate),
        why=result.why,
        memory_mib=chosen.memory_mib,
        step_s=chosen.step_s,
        result=result.as_dict(),
        table=format_table(result, fold=True),
    )


def _search(
    cfg: CfgNode, calibration: Calibration, world: tuple[int, int], memory_mib: float
) -> Planned:
    """The search on the measured machine (``world``: nodes, processes per
    node; ``memory_mib``: one device's), in a process of its own (the fake
    process group's traces)."""
    run = PaperRun.of(cfg, on_cpu=calibration.device_type == "cpu")
    machine = run.machine_of(calibration, *world, memory_mib)
    return _of_result(run.plan(machine))


def _device_memory_mib(device: torch.device, procs_per_node: int) -> float:
    """The memory of ``device``: a GPU's total, or this machine's RAM over
    the processes on it."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / MIB
    return PaperMachine(1, procs_per_node, "cpu").memory_mib()


def _search_apart(
    cfg: CfgNode, calibration: Calibration, world: tuple[int, int], memory_mib: float
) -> Planned:
    """:func:`_search` in a new (spawned) process; its error raised here."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        job = pool.submit(_search, cfg, calibration, world, memory_mib)
        return job.result()


def plan_here(cfg: CfgNode, info: du.LaunchInfo, device: torch.device) -> Planned:
    """Calibrate on every rank, search on rank 0, return its plan on every
    rank.  Raises ConfigError on every rank when nothing fits."""
    run = PaperRun.of(cfg, on_cpu=device.type == "cpu")
    model = build_configured(dataclasses.replace(model_spec(cfg), pretrained=False))
    calibration = calibrate(
        model.to(device),
        run.flops,
        image_size=largest_train_size(cfg),
        device=device,
        procs_per_node=info.local_world_size,
        batch=cfg.TRAIN.BATCH_SIZE,
        amp_dtype=run.amp_dtype,
    )
    del model
    if device.type == "cuda":  # the run's peak starts from an empty cache
        torch.cuda.empty_cache()
    nodes = max(1, info.world_size // info.local_world_size)
    answer: Planned | str
    if info.rank == 0:
        try:
            world = (nodes, info.local_world_size)
            memory = _device_memory_mib(device, info.local_world_size)
            answer = _search_apart(cfg, calibration, world, memory)
        except (NothingFitsError, ConfigError) as error:
            answer = f"DIST.STRATEGY auto: {error}"
    else:
        answer = ""
    answer = du.broadcast_object(answer)
    if isinstance(answer, str):
        raise ConfigError(answer)
    return dataclasses.replace(answer, peak_flops=calibration.peak_flops)


def _read_record(path: str) -> dict:
    """``plan.json``, a regular file of at most MAX_RECORD_BYTES (never
    waiting on a pipe, never following a link); ValueError otherwise."""
    data = read_small_file(path, MAX_RECORD_BYTES)
    record = json.loads(data)
    if not isinstance(record, dict) or not isinstance(record.get("keys"), dict):
        raise ValueError("no 'keys' object")
    unknown = sorted(set(record["keys"]) - RECORDED_KEYS)
    if unknown:
        raise ValueError(f"keys a plan does not set: {', '.join(unknown[:3])}")
    return record


def _number(value: Any) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return float(value) if ok else None


def recorded_plan(out_dir: str) -> Planned:
    """The plan a run in ``out_dir`` recorded; ConfigError when it is
    missing or unusable."""
    path = os.path.join(out_dir, RECORD)
    try:
        record = _read_record(path)
    except (OSError, ValueError, RecursionError) as error:
        raise ConfigError(
            f"DIST.STRATEGY auto: {out_dir} holds checkpoints to resume, but its "
            f"plan {path} is unusable ({error}); the checkpoints' layout depends "
            "on the plan: give the DIST.STRATEGY and TRAIN keys of its config.yaml, "
            "or a new OUT_DIR"
        ) from None
    return Planned(
        keys=record["keys"],
        why=f"the plan recorded in {path}",
        memory_mib=_number(record.get("memory_mib")),
        step_s=_number(record.get("step_s")),
    )


def _will_resume(cfg: CfgNode) -> bool:
    return cfg.TRAIN.AUTO_RESUME and bool(cp.list_checkpoints(cfg.OUT_DIR))


def resolve(
    cfg: CfgNode, info: du.LaunchInfo, device: torch.device, record: bool = True
) -> Planned | None:
    """Resolve ``DIST.STRATEGY auto`` in ``cfg`` (in place) on every rank:
    the plan recorded in OUT_DIR when the run resumes, else a new one (kept
    there when ``record``).  None, and ``cfg`` untouched, for another
    strategy.  Raises ConfigError when nothing fits or a recorded plan is
    unusable."""
    if cfg.DIST.STRATEGY != AUTO_STRATEGY:
        return None
    tic = time.perf_counter()
    resumed = _will_resume(cfg)
    planned = recorded_plan(cfg.OUT_DIR) if resumed else plan_here(cfg, info, device)
    try:
        merge_resolved(cfg, planned.keys)
    except (ConfigError, ValueError) as error:
        raise ConfigError(f"DIST.STRATEGY auto: {error}") from None
    logger.info(
        "DIST.STRATEGY auto ran %s in %.1f s: %s",
        "nothing (resumed)" if resumed else "the planner",
        time.perf_counter() - tic,
        ", ".join(f"{key} {value}" for key, value in planned.keys.items()),
    )
    if record and info.rank == 0 and not resumed:
        path = os.path.join(cfg.OUT_DIR, RECORD)
        text = json.dumps(planned.record(), indent=1).encode()
        atomic_write(path, lambda f: f.write(text))
    return planned


def _off(predicted: float | None, measured: float) -> bool:
    if not predicted:
        return False
    return abs(measured - predicted) > WARN_OFF_BY * predicted


class PlanCheck:
    """The plan's predictions against the run: the peak memory per process
    over the first :attr:`TRACKED` optimizer steps (MemTracker on a CPU,
    from before the strategy prepares the model; the allocator's peak on
    CUDA), then the median time of the next :attr:`TIMED` steps (the
    tracker off: it slows every operation)."""

    TRACKED, TIMED = 2, 3

    def __init__(self, planned: Planned, device: torch.device):
        self.planned, self.device = planned, device
        self.tracker: PeakTracker | None = None
        self.steps, self.times = 0, list[float]()
        self.tic, self.memory_mib = 0.0, 0.0
        self.done = False

    def start(self, model: nn.Module) -> None:
        """Begin measuring, ``model`` built and not yet prepared."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        self.tracker = PeakTracker(modules=False)
        self.tracker.track_external(model)
        self.tracker.__enter__()
        self.tracker.restart(recording=False)

    def _measured_mib(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / MIB
        return self.tracker.peak / MIB if self.tracker else 0.0

    def close(self) -> None:
        """Stop the tracker (idempotent; also on the way out of a failure)."""
        if self.tracker is not None:
            tracker, self.tracker = self.tracker, None
            tracker.__exit__(None, None, None)

    def after_step(self) -> bool:
        """Count an optimizer step; True once the line was logged."""
        if self.done:
            return True
        now = time.perf_counter()
        self.steps += 1
        if self.steps == self.TRACKED:
            self.memory_mib = max(du.all_gather_object(self._measured_mib()))
            self.close()
        elif self.steps > self.TRACKED:
            self.times.append(now - self.tic)
        self.tic = time.perf_counter()
        if len(self.times) == self.TIMED:
            self._log(statistics.median(self.times))
            self.done = True
        return self.done

    def finish(self) -> None:
        """Log the line with what was measured, if the run ended before all
        the steps were seen (a dry run, a short epoch)."""
        if self.done:
            return
        if self.steps < self.TRACKED:
            self.memory_mib = max(du.all_gather_object(self._measured_mib()))
            self.close()
        self._log(statistics.median(self.times) if self.times else None)
        self.done = True

    def _log(self, step_s: float | None) -> None:
        planned = self.planned

        def figure(value: float | None, form: str) -> str:
            return "-" if value is None else format(value, form)

        line = (
            f"predicted peak {figure(planned.memory_mib, '.0f')} MiB, measured "
            f"{self.memory_mib:.0f} MiB; predicted step {figure(planned.step_s, '.3f')}"
            f" s, measured {figure(step_s, '.3f')} s"
        )
        off = _off(planned.memory_mib, self.memory_mib) or (
            step_s is not None and _off(planned.step_s, step_s)
        )
        if du.get_rank() != 0:  # the figures are every rank's fullest
            return
        logger.log(logging.WARNING if off else logging.INFO, "%s", line)
        if off:
            logger.warning(
                "DIST.STRATEGY auto: a prediction is more than %.0f%% off; the "
                "plan may not be the best (docs/planner.md, its limits)",
                100 * WARN_OFF_BY,
            )
