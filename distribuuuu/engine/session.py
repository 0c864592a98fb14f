"""A run's process-wide set-up: the process group, logging, cuDNN and seeds."""

from __future__ import annotations

import contextlib
import logging
import os
import random
from collections.abc import Iterator

import numpy as np
import torch
from yacs.config import CfgNode

from distribuuuu.dist import group as du
from distribuuuu.dist.refusal import agree_inputs_usable
from distribuuuu.dist.worker_server import start_worker_server
from distribuuuu.engine.specs import AUTO_STRATEGY, run_precision, strategy_spec
from distribuuuu.logger import setup_logging
from distribuuuu.strategies import strategy_class

logger = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA) in this process."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def resolve_seed(seed: int | None) -> int:
    """``RNG_SEED``, or a random seed chosen by rank 0 and shared by all ranks."""
    if seed is None:
        seed = du.broadcast_object(random.SystemRandom().randrange(2**31))
    return seed


@contextlib.contextmanager
def run_context(
    cfg: CfgNode, log_files: bool = True
) -> Iterator[tuple[du.LaunchInfo, torch.device]]:
    """Join the process group, set up logging and cuDNN, log what
    TRAIN.MIXED_PRECISION auto stands for on the device (the config keeps
    ``auto``: see ``specs.run_precision``); leave the group at exit.

    Without ``log_files`` nothing is written to OUT_DIR (console only).
    """
    if cfg.TRAIN.WORKERS > 0:  # its imports overlap joining the group and building
        start_worker_server()
    if cfg.CUDNN.DETERMINISTIC:
        # cuBLAS needs this before its first use to be deterministic.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    spec = strategy_spec(cfg)
    # auto may choose fsdp, whose DIST.FSDP_CPU_OFFLOAD needs gloo beside nccl
    auto = cfg.DIST.STRATEGY == AUTO_STRATEGY and cfg.DIST.FSDP_CPU_OFFLOAD
    host_collectives = auto or strategy_class(spec.name).cpu_collectives(spec)
    info, device = du.setup_distributed(
        cfg.DIST.BACKEND,
        cfg.DEVICE,
        cfg.DIST.INIT_TIMEOUT,
        cpu_collectives=host_collectives,
    )
    try:
        # Before any log file: every rank exits 2 if rank 0 refused an input
        # it checks alone (OUT_DIR in use, the data).
        agree_inputs_usable()
        setup_logging(cfg.OUT_DIR if log_files else None, info.rank)
        if device.type == "cuda":
            set_cudnn_flags(cfg.CUDNN.BENCHMARK, cfg.CUDNN.DETERMINISTIC)
        logger.info(
            "launch: %s, rank %d of %d, local rank %d, device %s%s",
            info.launcher,
            info.rank,
            info.world_size,
            info.local_rank,
            device,
            f", backend {torch.distributed.get_backend()}"
            if du.is_distributed()
            else "",
        )
        if cfg.TRAIN.MIXED_PRECISION == "auto":
            precision = run_precision(cfg, device)
            logger.info("TRAIN.MIXED_PRECISION auto on %s: %s", device, precision)
        yield info, device
    finally:
        du.cleanup_distributed()


def set_cudnn_flags(benchmark: bool, deterministic: bool) -> None:
    """Set cuDNN's ``benchmark`` and ``deterministic`` flags for the run.

    Benchmark mode times the candidate algorithms of each new input shape
    and keeps the fastest, which may differ from run to run: PyTorch's notes
    on reproducibility ask for it off when results must repeat, so
    ``deterministic`` turns it off (and says so).
    """
    if deterministic and benchmark:
        logger.info(
            "CUDNN.DETERMINISTIC True: CUDNN.BENCHMARK turned off (its timing-based "
            "choice of algorithms varies from run to run)"
        )
        benchmark = False
    torch.backends.cudnn.benchmark = benchmark
    torch.backends.cudnn.deterministic = deterministic
