"""The planner's search space, on paper: every candidate keeps the global
batch, dp is never one, and what a strategy refuses is left out with the
strategy's own reason."""

from __future__ import annotations

import functools

import torch

from distribuuuu.config import get_cfg
from distribuuuu.engine.specs import strategy_spec
from distribuuuu.models import build_model
from distribuuuu.plan.candidate import (
    Candidate,
    RunFacts,
    enumerate_candidates,
    layouts,
)
from distribuuuu.strategies.spec import EMA

FIELDS = [
    "strategy", "tensor_parallel", "pipeline_stages", "pipeline_schedule",
    "data_parallel", "shard_size", "zero_stage", "offload", "micro_batch",
    "accum_steps", "act_ckpt",
]  # fmt: skip


def facts(arch: str, turned_on=None) -> RunFacts:
    cfg = get_cfg()
    cfg.MODEL.ARCH = arch

    def skeleton() -> torch.nn.Module:
        with torch.device("meta"):
            return build_model(arch, 10)

    return RunFacts(strategy_spec(cfg), functools.cache(skeleton), turned_on or {})


def test_every_candidate_keeps_the_global_batch_and_none_is_dp():
    """On 2 nodes x 2 processes, a global batch of 64: micro-batches are
    powers of two, accumulation makes up the rest over each candidate's
    replicas, and the layouts are the world's divisors."""
    candidates = enumerate_candidates(4, 2, 64, facts("vit_tiny_patch4"))
    assert candidates and all(list(c.as_dict()) == FIELDS for c in candidates)
    assert all(
        c.micro_batch * c.accum_steps * c.data_parallel == 64 for c in candidates
    )
    assert all(c.micro_batch & (c.micro_batch - 1) == 0 for c in candidates)
    strategies = {c.strategy for c in candidates}
    assert "dp" not in strategies
    assert {"ddp", "zero1", "fsdp", "pipeline"} <= strategies
    assert {c.pipeline_stages for c in candidates if c.strategy == "pipeline"} == {2, 4}
    assert {c.tensor_parallel for c in candidates if c.strategy == "ddp"} == {1, 2, 4}
    assert {c.act_ckpt for c in candidates} == {False, True}
    pipelines = [c for c in candidates if c.strategy == "pipeline"]
    assert all(c.data_parallel == 4 // c.pipeline_stages for c in pipelines)
    assert all(c.zero_stage is None and c.shard_size is None for c in pipelines)


def test_what_a_strategy_refuses_is_left_out_with_its_reason():
    """With MODEL.EMA on, DeepSpeed's ZeRO-3 says why it cannot run (its
    declaration), and resnet8 has no tensor-parallel plan (the model's
    check): neither is a candidate."""
    turned_on = {EMA: ("MODEL.EMA", True)}
    found = layouts(4, 2, facts("resnet8", turned_on))
    reasons = {(c.strategy, c.zero_stage, c.tensor_parallel): why for c, why in found}
    assert "ZERO_STAGE 3" in reasons[("deepspeed", 3, None)]
    assert "MODEL.EMA" in reasons[("deepspeed", 3, None)]
    assert reasons[("ddp", None, 2)]  # no plan splits resnet8's blocks
    assert reasons[("ddp", None, 1)] == ""
    candidates = enumerate_candidates(4, 2, 64, facts("resnet8", turned_on))
    assert not [c for c in candidates if c.zero_stage == 3]
    assert not [c for c in candidates if (c.tensor_parallel or 1) > 1]


def test_a_candidate_runs_as_the_strategy_spec_it_writes():
    """The settings a candidate resolves to are those its fields name."""
    base = facts("vit_tiny_patch4").spec
    pipeline = Candidate(
        strategy="pipeline", tensor_parallel=None, pipeline_stages=4,
        pipeline_schedule="gpipe", data_parallel=2, shard_size=None,
        zero_stage=None, offload=None, micro_batch=32, accum_steps=2, act_ckpt=True,
    )  # fmt: skip
    spec = pipeline.strategy_spec(base)
    assert (spec.name, spec.pipeline.stages, spec.pipeline.schedule) == (
        "pipeline",
        4,
        "gpipe",
    )
    assert spec.pipeline.micro_batches == 8  # twice the stages, as configured
    assert (spec.batch_size, spec.accum_steps) == (32, 2)
    assert spec.activation_checkpointing
