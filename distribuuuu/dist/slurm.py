"""Slurm helpers: host lists as Slurm writes them, and requeueing a job."""

from __future__ import annotations

import logging
import os
import re
import subprocess

logger = logging.getLogger(__name__)


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm hostlist such as ``node[01-03,07],gpu-[1-2]-ib``.

    Follows Slurm's grammar: comma-separated host expressions, each with any
    number of bracket groups of comma-separated numbers and ``lo-hi`` ranges;
    the zero padding of ``lo`` is kept.
    """
    hosts: list[str] = []
    for expr in _split_top_level(hostlist):
        hosts += _expand_expr(expr)
    return hosts


def _split_top_level(text: str) -> list[str]:
    parts: list[str] = []
    current: list[str] = []
    depth = 0
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in hostlist {text!r}")
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth:
        raise ValueError(f"unbalanced '[' in hostlist {text!r}")
    parts.append("".join(current))
    return [part.strip() for part in parts if part.strip()]


def _expand_expr(expr: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", expr)
    if match is None:
        return [expr]
    head, tail = expr[: match.start()], expr[match.end() :]
    out = []
    for item in match.group(1).split(","):
        bounds = item.strip().split("-")
        if len(bounds) == 1 and bounds[0].isdigit():
            numbers = [bounds[0]]
        elif len(bounds) == 2 and bounds[0].isdigit() and bounds[1].isdigit():
            width = len(bounds[0])
            lo, hi = int(bounds[0]), int(bounds[1])
            if hi < lo:
                raise ValueError(f"descending range {item!r} in hostlist {expr!r}")
            numbers = [str(n).zfill(width) for n in range(lo, hi + 1)]
        else:
            raise ValueError(f"bad range {item!r} in hostlist {expr!r}")
        for number in numbers:
            out += _expand_expr(head + number + tail)
    return out


def requeue_slurm_job() -> bool:
    """Ask Slurm to requeue this job (``scontrol requeue $SLURM_JOB_ID``)."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        logger.warning("DIST.REQUEUE True, but this is not a Slurm job")
        return False
    try:
        result = subprocess.run(
            ["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        logger.warning("could not requeue Slurm job %s: %s", job_id, error)
        return False
    if result.returncode != 0:
        logger.warning("scontrol requeue %s failed: %s", job_id, result.stderr.strip())
    return result.returncode == 0
