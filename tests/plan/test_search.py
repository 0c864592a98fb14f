"""The planner's search and ``tools/plan.py``, on paper: the issue's golden
plans, the search's monotone properties, and the tool's output and exits.

Each config's traces are shared between the machines it is planned on (a
module-scoped :class:`PaperRun`).  A trace of vit_b_16 takes about 10 s on
a CPU and vit_h_14's about 30 s: the plans that need them are marked slow
(those of vit_b_16 share its traces, about 25 s in all).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os

import pytest

from distribuuuu.config import load_cfg
from distribuuuu.plan.candidate import Candidate
from distribuuuu.plan.paper import NO_DATA, PaperMachine, PaperRun
from distribuuuu.plan.search import NothingFitsError, Scored, choose

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIELDS = [
    "strategy", "tensor_parallel", "pipeline_stages", "pipeline_schedule",
    "data_parallel", "shard_size", "zero_stage", "offload", "micro_batch",
    "accum_steps", "act_ckpt", "feasible", "memory_mib", "step_s", "comm_s",
    "reason",
]  # fmt: skip
TINY = [
    "MODEL.ARCH", "vit_tiny_patch4", "MODEL.NUM_CLASSES", "10",
    "TRAIN.IM_SIZE", "32", "TEST.IM_SIZE", "32", "TRAIN.BATCH_SIZE", "8",
]  # fmt: skip
VIT_B = [
    "MODEL.ARCH", "vit_b_16", "MODEL.NUM_CLASSES", "1000", "TRAIN.IM_SIZE", "224",
    "TEST.IM_SIZE", "224", "TRAIN.BATCH_SIZE", "32", "OPTIM.OPTIMIZER", "adamw",
    "MODEL.EMA", "True",
]  # fmt: skip


def plan_tool():
    """tools/plan.py of this checkout, as a module."""
    path = os.path.join(REPO, "tools", "plan.py")
    spec = importlib.util.spec_from_file_location("plan_tool", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def a100s(nodes: int, procs: int, gib: float | None = None, **links) -> PaperMachine:
    return PaperMachine(nodes, procs, "NVIDIA A100", gib, **links)


def chosen_step(run: PaperRun, machine: PaperMachine) -> float:
    """The chosen plan's predicted step (inf where nothing fits)."""
    try:
        return run.plan(machine).chosen.step_s or 0.0
    except NothingFitsError:
        return math.inf


@pytest.fixture(scope="module")
def vit_b() -> PaperRun:
    """vit_b_16 with AdamW and an EMA, 32 images per process, on GPUs."""
    return PaperRun.of(load_cfg(None, VIT_B), on_cpu=False)


@pytest.mark.slow  # 20 s of traces: the fast subset stays under 3 minutes
def test_resnet50_on_8_a100_40gb_picks_ddp():
    """config/resnet50.yaml on one node of 8 A100-40GB: plain ddp, which
    fits with room to spare, at the global batch of 8 x 32."""
    cfg = load_cfg(os.path.join(REPO, "config", "resnet50.yaml"), NO_DATA)
    result = PaperRun.of(cfg, on_cpu=False).plan(a100s(1, 8))
    chosen = result.chosen.candidate
    assert chosen.strategy == "ddp" and chosen.tensor_parallel in (None, 1)
    assert chosen.micro_batch * chosen.accum_steps * chosen.data_parallel == 256
    assert result.chosen.memory_mib is not None
    assert result.chosen.memory_mib <= 0.9 * 40 * 1024
    assert "ddp" in result.why


@pytest.mark.slow
def test_vit_h_14_with_adamw_and_ema_on_12_gib_is_sharded():
    """vit_h_14, AdamW, MODEL.EMA on 8 devices of 12 GiB: the parameters,
    gradients, Adam's state and the EMA alone exceed 12 GiB x 0.9, so no ddp
    candidate fits at any micro-batch, and the chosen plan is sharded."""
    overrides = ["MODEL.ARCH", "vit_h_14", "OPTIM.OPTIMIZER", "adamw"]
    overrides += ["MODEL.EMA", "True", "TRAIN.IM_SIZE", "224", "TEST.IM_SIZE", "224"]
    run = PaperRun.of(load_cfg(None, overrides), on_cpu=False)
    result = run.plan(a100s(1, 8, 12))
    limit = 0.9 * 12 * 1024
    ddp = [
        s
        for s in result.candidates
        if s.candidate.strategy == "ddp" and not s.refused
        if (s.candidate.tensor_parallel or 1) == 1
    ]
    assert ddp and not any(s.feasible for s in ddp)
    whole = run.memory.estimate(ddp[0].candidate)
    state = whole.parameters_mib + whole.gradients_mib + whole.optimizer_mib
    assert state + whole.ema_mib > limit
    chosen = result.chosen
    assert (chosen.candidate.strategy, chosen.candidate.tensor_parallel or 1) != (
        "ddp",
        1,
    )
    assert chosen.feasible and (chosen.memory_mib or 0.0) <= limit


@pytest.mark.slow
def test_two_nodes_at_10_gbps_pick_hsdp_over_fsdp(vit_b):
    """vit_b_16 with AdamW and an EMA on 2 nodes x 8 devices of 1 GiB joined
    at 10 Gbit/s: ddp and ZeRO-1 do not fit, and hsdp, which gathers within
    a node, is chosen over fsdp, which gathers across the slow link."""
    result = vit_b.plan(a100s(2, 8, 1, inter_gbps=10))
    assert result.chosen.candidate.strategy == "hsdp"
    assert result.chosen.candidate.shard_size == 8
    replicated = [
        s for s in result.candidates if s.candidate.strategy in ("ddp", "zero1")
    ]
    assert not any(s.feasible for s in replicated)
    fsdp = [s.step_s for s in result.candidates if s.candidate.strategy == "fsdp"]
    assert min(s for s in fsdp if s is not None) > result.chosen.step_s


@pytest.mark.slow
def test_vit_b_16_on_4_x_8_devices_of_2_gib(vit_b):
    """On 4 nodes x 8 devices of 2 GiB, the chosen plan needs at most
    2 GiB x 0.9, or the search names a smallest need above it."""
    limit = 0.9 * 2 * 1024
    try:
        result = vit_b.plan(a100s(4, 8, 2, inter_gbps=100))
    except NothingFitsError as error:
        need = float(str(error).split("smallest needs ")[1].split(" MiB")[0])
        assert need > limit
        return
    assert result.chosen.feasible
    assert result.chosen.memory_mib is not None and result.chosen.memory_mib <= limit
    ddp = [
        s
        for s in result.candidates
        if s.candidate.strategy == "ddp" and (s.candidate.tensor_parallel or 1) == 1
    ]
    assert any(s.memory_mib and s.memory_mib > limit for s in ddp)
    assert not any(s.feasible for s in ddp)


@pytest.mark.slow
def test_more_memory_never_makes_the_chosen_step_slower(vit_b):
    """On 2 nodes x 8 joined at 100 Gbit/s, from 1 to 80 GiB a device (the
    traces of the hsdp plan above serve most of them)."""
    steps = [
        chosen_step(vit_b, a100s(2, 8, gib, inter_gbps=100))
        for gib in (1, 1.5, 2, 4, 80)
    ]
    assert steps == sorted(steps, reverse=True), steps
    assert steps[-1] < steps[0]


@pytest.mark.slow
def test_a_slower_link_never_makes_the_chosen_step_faster(vit_b):
    """On 2 nodes x 8 devices of 2 GiB, links from 400 to 1 Gbit/s."""
    steps = [
        chosen_step(vit_b, a100s(2, 8, 2, inter_gbps=gbps))
        for gbps in (400, 100, 25, 10, 1)
    ]
    assert steps == sorted(steps), steps
    assert steps[-1] > steps[0]


def scored(strategy: str, step_s: float, **fields) -> Scored:
    """A feasible candidate of ``strategy`` predicted at ``step_s``."""
    base = Candidate(
        strategy, None, None, None, 8, None, None, None, 4, 1, act_ckpt=False
    )
    return Scored(dataclasses.replace(base, **fields), True, 100.0, step_s, 0.0, "")


def test_within_5_percent_the_simpler_strategy_is_chosen():
    """ddp < zero1 < fsdp < hsdp < deepspeed < tensor parallel < pipeline:
    a simpler plan at most 5% slower than the fastest wins, one further
    behind does not."""
    order = [
        scored("pipeline", 1.0, pipeline_stages=2, pipeline_schedule="1f1b"),
        scored("ddp", 1.0, tensor_parallel=2),
        scored("deepspeed", 1.0, zero_stage=2, offload="none"),
        scored("hsdp", 1.0, shard_size=4),
        scored("fsdp", 1.0),
        scored("zero1", 1.0),
        scored("ddp", 1.0),
    ]
    for simpler, fancier in zip(order[1:], order):
        faster = dataclasses.replace(fancier, step_s=0.96)
        assert choose([faster, simpler])[0] is simpler
        far_faster = dataclasses.replace(fancier, step_s=0.94)
        chosen, why = choose([far_faster, simpler])
        assert chosen is far_faster and "fastest" in why
    infeasible = dataclasses.replace(order[-1], feasible=False)
    assert choose([order[0], infeasible])[0] is order[0]


def test_plan_tool_json_has_the_issues_fields(capsys):
    """--json: every candidate and the chosen one carry exactly the issue's
    fields, null where they do not apply; the chosen one fits."""
    args = ["--nodes", "1", "--procs-per-node", "2", "--device", "NVIDIA A100"]
    assert plan_tool().main([*args, "--json", *TINY]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"candidates", "chosen"}
    assert all(list(c) == FIELDS for c in [*out["candidates"], out["chosen"]])
    chosen = out["chosen"]
    assert chosen["feasible"] is True and chosen["strategy"] == "ddp"
    assert chosen["pipeline_stages"] is None and chosen["zero_stage"] is None
    assert chosen["micro_batch"] * chosen["accum_steps"] * 2 == 16
    pipelines = [c for c in out["candidates"] if c["strategy"] == "pipeline"]
    assert pipelines and all(c["pipeline_schedule"] for c in pipelines)
    assert all(c["tensor_parallel"] is None for c in pipelines)


def test_plan_tool_prints_the_table_and_the_choice(capsys):
    """Text: a header, a row per candidate with its memory, step and
    verdict, the chosen row marked, and the choice with its reason."""
    args = ["--nodes", "1", "--procs-per-node", "1", "--device", "A100"]
    assert plan_tool().main([*args, *TINY]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["candidate", "memory", "MiB", "step"]
    marked = [line for line in lines if line.startswith("*")]
    assert len(marked) == 1 and marked[0][1:].startswith("ddp, micro-batch 8 x 1 ")
    assert marked[0].rstrip().endswith("fits")
    assert lines[-1].startswith("chosen: ddp, micro-batch 8 x 1")
    assert any("not estimated" in line or "fits" in line for line in lines[1:-1])


def test_plan_tool_exits_2_naming_the_smallest_need(capsys):
    """Devices of 1 MiB: exit 2 and one error line with the smallest need."""
    args = ["--nodes", "1", "--procs-per-node", "1", "--device", "A100"]
    code = plan_tool().main([*args, "--device-memory", "0.001", *TINY])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith("error: no plan fits: the smallest needs ")
    need = float(err[0].split("smallest needs ")[1].split(" MiB")[0])
    assert need > 1


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--device", "TPU v5", "--nodes", "1", "--procs-per-node", "1"], "TPU v5"),
        (["--device", "A100", "--nodes", "2", "--procs-per-node", "8"], "--inter-gbps"),
        (["--device", "A100", "--nodes", "0", "--procs-per-node", "8"], "--nodes"),
        (["--device", "A100", "--procs-per-node", "8"], "--nodes"),
    ],
)
def test_plan_tool_exits_2_on_a_bad_flag(capsys, argv, words):
    """An unknown device, a link the plan needs without its flag, a bad or
    missing count: exit 2 and one error line that names it."""
    assert exit_code([*argv, *TINY]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("error: ") and words in err[0]


def exit_code(argv: list[str]) -> int:
    """tools/plan.py's exit code for ``argv`` (argparse's exit included)."""
    try:
        return plan_tool().main(argv)
    except SystemExit as stop:
        return int(stop.code or 0)
