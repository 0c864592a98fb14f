"""The search: every candidate of a run on a machine, its memory and step
time, and the one to run.

The rules (issue 35):

- the global batch is the one plain ddp would have (TRAIN.BATCH_SIZE x
  TRAIN.ACCUM_STEPS x processes); each candidate reaches it with
  power-of-two micro-batches and accumulation
  (:func:`~distribuuuu.plan.candidate.enumerate_candidates`);
- a candidate whose predicted peak per rank exceeds ``headroom`` x the
  device's memory is dropped;
- of the rest the fastest predicted step wins, but within
  :data:`PREFERENCE_WINDOW` of it the simpler strategy is preferred, in the
  order of :data:`SIMPLER_FIRST` (tensor parallelism and pipelines last);
  dp is never a candidate.

Memory is estimated lazily: the step times are computed first (they cost
microseconds), then candidates are weighed fastest first, and a trace
(seconds) is only run for a candidate that could still be chosen.  A
candidate slower than the window whose traces were not needed keeps
``memory_mib`` None and says so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from distribuuuu.plan.candidate import Candidate, RunFacts, enumerate_candidates
from distribuuuu.plan.candidate import layouts as all_layouts
from distribuuuu.plan.cost import COLLECTIVES, Workload, step_cost
from distribuuuu.plan.links import Cluster
from distribuuuu.plan.memory import MemoryModel, supported

# Within this share of the fastest step, the simpler strategy is preferred.
PREFERENCE_WINDOW = 0.05
# Simpler first; a candidate with tensor parallelism ranks after all of
# these, a pipeline after that.
SIMPLER_FIRST = ("ddp", "zero1", "fsdp", "hsdp", "deepspeed")
# The rows of a folded table (the start-up report's).
FOLDED_ROWS = 8
SKIPPED = "not estimated: its step is slower than the chosen plan's window"


class NothingFitsError(ValueError):
    """No candidate fits the device's memory (the message names the
    smallest need)."""


@dataclasses.dataclass(frozen=True)
class Scored:
    """One candidate with what the planner found: ``feasible`` None where
    its memory was not estimated; ``micro_batch`` and the batch fields are
    reported as None for a layout its strategy refuses (``refused``)."""

    candidate: Candidate
    feasible: bool | None
    memory_mib: float | None
    step_s: float | None
    comm_s: float | None
    reason: str
    refused: bool = False

    def as_dict(self) -> dict[str, Any]:
        """The issue's fields of ``tools/plan.py --json``'s candidates."""
        fields = self.candidate.as_dict()
        if self.refused:
            fields.update(micro_batch=None, accum_steps=None, act_ckpt=None)
        fields.update(
            feasible=self.feasible,
            memory_mib=None if self.memory_mib is None else round(self.memory_mib, 1),
            step_s=None if self.step_s is None else round(self.step_s, 6),
            comm_s=None if self.comm_s is None else round(self.comm_s, 6),
            reason=self.reason,
        )
        return fields


@dataclasses.dataclass(frozen=True)
class PlanResult:
    """Every candidate weighed (fastest first, then the refused) and the
    chosen one with why."""

    candidates: tuple[Scored, ...]
    chosen: Scored
    why: str
    limit_mib: float

    def as_dict(self) -> dict[str, Any]:
        """``{"candidates": [...], "chosen": {...}}`` (the chosen one's
        ``reason`` says why it was chosen)."""
        chosen = self.chosen.as_dict()
        chosen["reason"] = self.why
        return {
            "candidates": [scored.as_dict() for scored in self.candidates],
            "chosen": chosen,
        }


@dataclasses.dataclass(frozen=True)
class Machine:
    """Where the plan runs: the world's shape, its links and speed, the
    memory a rank may fill, and the run's workload as the cost model reads
    it on this machine."""

    cluster: Cluster
    device_memory_mib: float
    headroom: float
    workload: Workload

    @property
    def limit_mib(self) -> float:
        """The most a rank's predicted peak may be."""
        return self.device_memory_mib * self.headroom


def simplicity(candidate: Candidate) -> int:
    """The rank of ``candidate`` in the preference order (0 simplest)."""
    if candidate.strategy == "pipeline":
        return len(SIMPLER_FIRST) + 1
    if (candidate.tensor_parallel or 1) > 1:
        return len(SIMPLER_FIRST)
    if candidate.strategy in SIMPLER_FIRST:
        return SIMPLER_FIRST.index(candidate.strategy)
    return len(SIMPLER_FIRST) + 2


def _tie_break(candidate: Candidate) -> tuple:
    """Between equal steps: the simpler, fewer accumulation steps, no
    recomputation."""
    return simplicity(candidate), candidate.accum_steps, candidate.act_ckpt


def _rounded(seconds: float | None) -> float:
    """``seconds`` to 4 significant digits: steps that differ by rounding
    alone are equal."""
    return float(f"{seconds or 0.0:.4g}")


def traces_of(candidate: Candidate) -> frozenset[tuple]:
    """The traces :class:`MemoryModel` runs to estimate ``candidate``."""
    act = candidate.act_ckpt
    if candidate.strategy == "pipeline":  # the chain, and the optimizer's factor
        return frozenset({("chain", act), ("split", 1, False)})
    return frozenset({("split", candidate.tensor_parallel or 1, act)})


def _unmodelled(candidate: Candidate) -> str:
    name = candidate.strategy
    if not supported(name) or (name != "pipeline" and name not in COLLECTIVES):
        return f"the planner has no model of DIST.STRATEGY {name}"
    return ""


class _Weigher:
    """Memory of candidates, tracing only when asked; remembers the traces
    run."""

    def __init__(self, memory: MemoryModel, limit_mib: float):
        self.memory, self.limit_mib = memory, limit_mib
        self.traced: set[tuple] = set()

    def cheap(self, candidate: Candidate) -> bool:
        return traces_of(candidate) <= self.traced

    def weigh(self, candidate: Candidate) -> tuple[bool, float, str]:
        self.traced |= traces_of(candidate)
        need = self.memory.estimate(candidate).peak_mib
        if need > self.limit_mib:
            why = f"needs {need:.0f} MiB, over the limit of {self.limit_mib:.0f} MiB"
            return False, need, why
        return True, need, ""


def _weigh_all(timed: list[tuple[Candidate, Any]], weigher: _Weigher) -> list[Scored]:
    """Weigh ``timed`` (fastest first) until no slower one can be chosen."""
    scored, fastest = [], None
    for candidate, cost in timed:
        within = fastest is None or cost.step_s <= fastest * (1 + PREFERENCE_WINDOW)
        if within or weigher.cheap(candidate):
            feasible, need, why = weigher.weigh(candidate)
            if feasible and fastest is None:
                fastest = cost.step_s
        else:
            feasible, need, why = None, None, SKIPPED
        scored.append(Scored(candidate, feasible, need, cost.step_s, cost.comm_s, why))
    return scored


def choose(scored: Iterable[Scored]) -> tuple[Scored, str]:
    """The fastest feasible candidate, or within the window of it the
    simplest; with the reason in words."""
    feasible = [s for s in scored if s.feasible]
    fastest = min(feasible, key=lambda s: s.step_s or 0.0)
    best = fastest.step_s or 0.0
    window = [
        s for s in feasible if (s.step_s or 0.0) <= best * (1 + PREFERENCE_WINDOW)
    ]
    chosen = min(
        window,
        key=lambda s: (
            simplicity(s.candidate),
            _rounded(s.step_s),
            *_tie_break(s.candidate),
        ),
    )
    name = describe(chosen.candidate)
    if chosen is fastest:
        why = f"{name}: the fastest predicted step that fits ({best:.4g} s)"
    else:
        why = (
            f"{name}: within {PREFERENCE_WINDOW:.0%} of the fastest that fits "
            f"({describe(fastest.candidate)}, {best:.4g} s) and simpler"
        )
    return chosen, why


def describe(candidate: Candidate) -> str:
    """A candidate in a few words: ``fsdp x tp 2, micro-batch 8 x 4``."""
    words = [candidate.strategy]
    if (candidate.tensor_parallel or 1) > 1:
        words.append(f"x tp {candidate.tensor_parallel}")
    if candidate.pipeline_stages:
        words.append(
            f"{candidate.pipeline_stages} stages {candidate.pipeline_schedule}"
        )
    if candidate.shard_size:
        words.append(f"shard {candidate.shard_size}")
    if candidate.zero_stage:
        words.append(f"zero {candidate.zero_stage} offload {candidate.offload}")
    text = " ".join(words)
    text += f", micro-batch {candidate.micro_batch} x {candidate.accum_steps}"
    return text + (", act. ckpt" if candidate.act_ckpt else "")


def plan(
    run: RunFacts, memory: MemoryModel, machine: Machine, global_batch: int
) -> PlanResult:
    """Weigh every candidate of ``run`` for ``global_batch`` samples per
    optimizer step on ``machine`` and choose one.

    Raises NothingFitsError naming the smallest memory a candidate needs
    when none fits (or ValueError when the world admits no candidate).
    """
    cluster = machine.cluster
    world = cluster.nodes * cluster.procs_per_node
    candidates = enumerate_candidates(world, cluster.procs_per_node, global_batch, run)
    unmodelled = [
        Scored(c, False, None, None, None, _unmodelled(c)) for c in candidates
    ]
    unmodelled = [s for s in unmodelled if s.reason]
    timed = [
        (c, step_cost(c, machine.workload, cluster))
        for c in candidates
        if not _unmodelled(c)
    ]
    timed.sort(key=lambda pair: (pair[1].step_s, *_tie_break(pair[0])))
    scored = _weigh_all(timed, _Weigher(memory, machine.limit_mib))
    refused = [
        Scored(layout, False, None, None, None, why, refused=True)
        for layout, why in all_layouts(world, cluster.procs_per_node, run)
        if why
    ]
    everything = (*scored, *unmodelled, *refused)
    if not any(s.feasible for s in scored):
        needs = [s.memory_mib for s in scored if s.memory_mib is not None]
        if not needs:
            raise NothingFitsError(
                f"no strategy the planner models can run {global_batch} samples "
                f"per step on {world} processes"
            )
        raise NothingFitsError(
            f"no plan fits: the smallest needs {min(needs):.0f} MiB per device, "
            f"over {machine.headroom:g} x {machine.device_memory_mib:.0f} MiB "
            f"= {machine.limit_mib:.0f} MiB (DIST.AUTO.HEADROOM x the device's memory)"
        )
    chosen, why = choose(scored)
    return PlanResult(everything, chosen, why, machine.limit_mib)


def format_table(result: PlanResult, fold: bool = False) -> str:
    """The candidates as a table, and the choice with its reason.  With
    ``fold`` (the start-up report) the candidates that were not estimated
    or that their strategy refuses are counted in a line each instead, and
    only the :data:`FOLDED_ROWS` fastest of the others are shown (and the
    chosen one)."""
    rows = list(result.candidates)
    folded: dict[str, int] = {}
    if fold:
        kept = []
        for scored in rows:
            if scored.reason == SKIPPED or scored.refused:
                key = SKIPPED if scored.reason == SKIPPED else "refused by its strategy"
                folded[key] = folded.get(key, 0) + 1
            else:
                kept.append(scored)
        rows = [s for i, s in enumerate(kept) if i < FOLDED_ROWS or s is result.chosen]
        if len(kept) > len(rows):
            folded["weighed, slower or larger than those shown"] = len(kept) - len(rows)
    names = [
        describe(s.candidate).split(", micro-batch")[0]
        if s.refused
        else describe(s.candidate)
        for s in rows
    ]
    width = max(len("candidate"), *(len(name) for name in names)) + 1
    lines = [
        f" {'candidate':<{width}}{'memory MiB':>10} {'step s':>9} {'comm s':>9}  "
        "verdict"
    ]
    for scored, name in zip(rows, names):
        memory = "-" if scored.memory_mib is None else f"{scored.memory_mib:.0f}"
        step = "-" if scored.step_s is None else f"{scored.step_s:.4g}"
        comm = "-" if scored.comm_s is None else f"{scored.comm_s:.4g}"
        verdict = "fits" if scored.feasible else scored.reason
        mark = "*" if scored is result.chosen else " "
        lines.append(
            f"{mark}{name:<{width}}{memory:>10} {step:>9} {comm:>9}  {verdict}"
        )
    lines.extend(f" ... {n} more: {why}" for why, n in folded.items())
    lines.append(f"chosen: {result.why}")
    return "\n".join(lines)
