"""Run a checked config: this process's rank of the job, or ``--num-procs`` ones.

:func:`run_job` is what ``tools/train_net.py`` calls once the config and the
inputs passed the checks of :mod:`distribuuuu.preflight`: it trains,
evaluates or dry-runs the config in this process (one rank of a job started
by torchrun, srun or nothing) or in ``--num-procs`` local processes.  Each
rank writes the traceback of a failure to its log file; the exit codes and
the error line are :mod:`distribuuuu.cli`'s.

torch is imported inside the functions: importing this module is cheap.
"""

from __future__ import annotations

import logging
import os
import signal

from yacs.config import CfgNode

from distribuuuu.cli import describe_error, is_rank_zero
from distribuuuu.dist.launcher_env import launched_rank
from distribuuuu.logger import PACKAGE_LOGGER


def is_launched() -> bool:
    """True when a launcher (torchrun, srun, mpirun) started this process as a rank."""
    return launched_rank(os.environ) is not None


def job_world_size(num_procs: int) -> int:
    """Processes of the job: ``num_procs`` (--num-procs), or what the launcher says."""
    from distribuuuu.dist.group import detect_launch

    return num_procs if num_procs > 1 else detect_launch().world_size


def _train_or_evaluate(cfg: CfgNode, eval_only: bool, dry_run: bool = False) -> None:
    """Train or evaluate ``cfg`` in this process (one rank of the job)."""
    from distribuuuu.engine import trainer  # imports torch: after the config checks

    if dry_run:
        trainer.dry_run(cfg)
        return
    if not eval_only:
        stats = trainer.train_model(cfg)
        if "stopped_by" in stats:  # SIGTERM/SIGUSR1: saved, not finished
            # srun --kill-on-bad-exit answers the first rank to exit with a
            # SIGTERM to the others: let them exit 128+N all the same.
            for signum in (signal.SIGTERM, signal.SIGUSR1):
                signal.signal(signum, signal.SIG_IGN)
            raise SystemExit(128 + stats["stopped_by"])
        return
    from distribuuuu.engine.label_set_log import metrics_text

    stats = trainer.evaluate_checkpoint(cfg)
    if is_rank_zero():
        metrics = metrics_text(stats, stats.get("topk_k", 0))
        print(f"{metrics}  loss {stats['loss']:.4f}  samples {stats['samples']}")


def rank_main(cfg: CfgNode, eval_only: bool, dry_run: bool = False) -> None:
    """Train, evaluate or dry-run ``cfg`` as this rank; log a failure's traceback.

    The traceback goes to this rank's log file.  A collective that timed out
    or lost a peer is told as a PeerLostError that names DIST.INIT_TIMEOUT and
    the ranks that did not answer.  A run that finished releases its process
    groups before the interpreter exits (not one that failed: a peer may still
    hang in a collective).
    """
    from distribuuuu.dist.group import release_groups
    from distribuuuu.dist.peers import peer_failure

    try:
        _train_or_evaluate(cfg, eval_only, dry_run)
    except Exception as error:
        lost = peer_failure(error)
        _log_traceback(lost or error)
        if lost is not None:
            raise lost from error
        raise
    release_groups()


def _log_traceback(error: Exception) -> None:
    """Write ``error`` and its traceback to the log files, not to the console."""
    logger = logging.getLogger(PACKAGE_LOGGER)
    record = logger.makeRecord(
        logger.name,
        logging.ERROR,
        __file__,
        0,
        "the run failed: %s",
        (describe_error(error),),
        (type(error), error, error.__traceback__),
    )
    for handler in logger.handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def run_job(
    cfg: CfgNode, num_procs: int = 1, eval_only: bool = False, dry_run: bool = False
) -> None:
    """Run ``cfg`` (:func:`rank_main`) here, or in ``num_procs`` local processes."""
    from distribuuuu.dist.spawn import spawn

    if num_procs > 1:
        spawn(num_procs, rank_main, (cfg, eval_only, dry_run))
    else:
        rank_main(cfg, eval_only, dry_run)
