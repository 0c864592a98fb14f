"""The start-up report of a training run: what it is about to do, logged,
recorded in metrics.jsonl and shown in tensorboard."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from yacs.config import CfgNode

from distribuuuu.data import describe_decoder
from distribuuuu.dist import group as du
from distribuuuu.engine import specs
from distribuuuu.engine.state import TrainState
from distribuuuu.reporting import reports

if TYPE_CHECKING:
    from distribuuuu.plan.auto import Planned

logger = logging.getLogger(__name__)


def report_start(
    cfg: CfgNode,
    info: du.LaunchInfo,
    state: TrainState,
    *,
    size: dict,
    sizes: dict,
    start: str,
    planned: Planned | None = None,
) -> None:
    """Log, record and show in tensorboard what the run is about to do.

    ``size``: the model's size (:func:`reports.model_size`); ``sizes``: the
    number of training and validation images; ``start``: what the run starts
    from, in words; ``planned``: DIST.STRATEGY auto's, whose table the report
    shows (and the metrics keep in a line of their own).
    """
    plan, progress = state.plan, state.progress
    report = {
        "versions": reports.versions(),
        "world": reports.world_layout(info, state.device),
        "data": {
            "name": cfg.DATA.NAME,
            **sizes,
            "class_names": state.classes,
            "decoder": describe_decoder(specs.data_spec(cfg)),
        },
        "model": {"arch": cfg.MODEL.ARCH, "syncbn": cfg.MODEL.SYNCBN, **size},
        "batch": {
            "per_rank": plan.per_rank,
            "accum": plan.accum,
            "world_size": plan.world_size,
            "global": plan.global_batch,
        },
        "memory": fullest(state.strategy.memory_mb(state.model)),
        "lr": cfg.OPTIM.BASE_LR * plan.lr_scale,
        "lr_policy": cfg.OPTIM.LR_POLICY,
        "strategy": state.strategy.describe(state.model),
        "precision": "none"
        if state.amp_dtype is None
        else str(state.amp_dtype).split(".")[-1],
        "seed": f"{progress.seed}" + " (picked at random)" * (cfg.RNG_SEED is None),
        "start": start,
    }
    if planned is not None:
        report["plan"] = {"why": planned.why, "table": planned.table}
        state.writer.write({"split": "plan", **planned.record()})
    text = reports.format_startup(report)
    logger.info("%s", text)
    state.writer.write({"split": "start", **report})
    state.writer.text("run/start", "    " + text.replace("\n", "\n    "))


def fullest(memory: dict) -> dict:
    """Each figure of ``memory`` (MiB on this process) at its largest over the
    processes; a collective."""
    every = du.all_gather_object(memory)
    return {key: max(part[key] for part in every) for key in memory}
