"""The checks of OUT_DIR before a run writes there, each raising a ConfigError.

Not the root of the file system; created and proved writable (a probe
written, synced and removed), or, for a dry run, creatable without creating
anything; and the checkpoints of an earlier run in it, which a new run must
not overwrite nor a resume be refused.  :mod:`distribuuuu.preflight` runs
them (with the lock of :mod:`distribuuuu.engine.run_lock`) after the checks
of the inputs; they take plain values, not the config.
"""

from __future__ import annotations

import contextlib
import os
import tempfile

from distribuuuu.errors import ConfigError, RefusedCheckpointError


def checkpoints_in(out_dir: str) -> tuple[list[str], list[str]]:
    """The training checkpoints and best weights in ``out_dir``."""
    from distribuuuu import checkpoint as cp

    checkpoints = [path for _, path in cp.list_checkpoints(out_dir)]
    best = [os.path.join(out_dir, n) for n in (cp.BEST_WEIGHTS, cp.BEST_EMA_WEIGHTS)]
    return checkpoints, [path for path in best if os.path.lexists(path)]


def check_previous_run(out_dir: str, auto_resume: bool, dry_run: bool = False) -> None:
    """Refuse the checkpoints of an earlier run in ``out_dir`` that a new one
    would overwrite (TRAIN.AUTO_RESUME False) or that resuming would refuse."""
    checkpoints, best = checkpoints_in(out_dir)
    found = checkpoints + best
    if found and not auto_resume and not dry_run:
        raise ConfigError(
            f"TRAIN.AUTO_RESUME False: OUT_DIR {out_dir} already holds "
            f"{len(found)} checkpoint files of a run ({found[0]}"
            f"{', ...' * (len(found) > 1)}), which a new run would overwrite; use "
            "a fresh OUT_DIR, or TRAIN.AUTO_RESUME True to continue that run"
        )
    if auto_resume:
        check_resume(out_dir)


def check_resume(out_dir: str) -> None:
    """Refuse an OUT_DIR whose checkpoint would be refused; raise ConfigError.

    A checkpoint that would build code or reach files elsewhere is refused;
    damaged ones are skipped when resuming, and pass.
    """
    from distribuuuu import checkpoint as cp

    try:
        cp.find_resume_checkpoint(out_dir, warn=False)
    except RefusedCheckpointError as error:
        raise ConfigError(f"OUT_DIR checkpoint {error}; remove it") from error


def check_out_dir_path(out_dir: str) -> None:
    """Refuse an OUT_DIR that is (or resolves to) the root of the file system."""
    resolved = os.path.realpath(out_dir)
    if os.path.dirname(resolved) == resolved:  # "/" (a drive's root elsewhere)
        via = "" if out_dir == resolved else f", which resolves to {resolved},"
        raise ConfigError(
            f"OUT_DIR {out_dir}{via} is the root of the file system: a run writes "
            "its config, logs and checkpoints there; give it a folder of its own, "
            "e.g. OUT_DIR ./runs/first"
        )


def missing_dirs(path: str) -> list[str]:
    """``path`` and those of its parents that do not exist yet, outermost first."""
    missing = []
    path = os.path.abspath(path)
    while not os.path.lexists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing[::-1]


def _write_probe(directory: str) -> None:
    fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=directory)
    try:
        os.write(fd, b"distribuuuu checks that OUT_DIR is writable\n")
        os.fsync(fd)
    finally:
        os.close(fd)
        os.remove(probe)


def remove_dirs(created: list[str]) -> None:
    """Remove the directories of :func:`missing_dirs`, innermost first."""
    for directory in reversed(created):
        with contextlib.suppress(OSError):
            os.rmdir(directory)


def check_out_dir(out_dir: str, keep: bool = True) -> None:
    """Create ``out_dir`` and prove it writable (write, fsync, delete a probe).

    Raises a ConfigError naming the directory and the reason (no space, no
    permission, a file in the way, ...); directories it created are removed.
    Unless ``keep`` (a dry run; its ranks check at once), nothing is created:
    the probe goes to the nearest existing folder."""
    created = missing_dirs(out_dir)
    nearest = os.path.dirname(created[0]) if created else os.path.abspath(out_dir)
    if not os.path.isdir(nearest):
        culprit = nearest if created else "it"
        raise ConfigError(f"OUT_DIR {out_dir}: {culprit} exists but is not a directory")
    made = created if keep else []
    try:
        if made:
            os.makedirs(out_dir, exist_ok=True)
        _write_probe(out_dir if keep else nearest)
    except OSError as error:
        remove_dirs(made)
        reason = error.strerror or str(error)
        raise ConfigError(f"OUT_DIR {out_dir}: cannot write there: {reason}") from error
    except BaseException:  # Ctrl-C, a signal: leave nothing behind
        remove_dirs(made)
        raise
