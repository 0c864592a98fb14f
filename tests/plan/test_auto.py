"""``DIST.STRATEGY auto``: the plan made at start-up is the one that runs,
config.yaml records it, a resumed run reuses it, and its predictions are
checked against the run."""

from __future__ import annotations

import json
import os
import re

import pytest
from helpers import FAST, TINY, assert_ok, read_metrics, read_text, torchrun, train_net

from distribuuuu.config import load_cfg
from distribuuuu.engine.specs import strategy_spec
from distribuuuu.errors import ConfigError
from distribuuuu.plan import auto
from distribuuuu.plan.candidate import OFFLOAD_OPTIMIZER, Candidate

LINE = re.compile(r"predicted peak (\d+) MiB, measured (\d+) MiB")

CANDIDATES = [
    Candidate("ddp", None, None, None, 4, None, None, None, 16, 2, False),
    Candidate("fsdp", 2, None, None, 2, None, None, None, 8, 4, True),
    Candidate("hsdp", None, None, None, 4, 2, None, None, 32, 1, False),
    Candidate("pipeline", None, 2, "gpipe", 2, None, None, None, 64, 1, False),
    Candidate("deepspeed", None, None, None, 4, None, 3, OFFLOAD_OPTIMIZER, 8, 1, True),
]


@pytest.mark.parametrize("candidate", CANDIDATES, ids=lambda c: c.strategy)
def test_the_keys_of_a_plan_run_that_plan(candidate):
    keys = auto.overrides(candidate)
    assert set(keys) <= auto.RECORDED_KEYS
    opts = [str(x) for pair in keys.items() for x in pair]
    cfg = load_cfg(None, ["DIST.STRATEGY", "auto", *opts, "MODEL.DUMMY_INPUT", "True"])
    base = strategy_spec(load_cfg(None, ["MODEL.DUMMY_INPUT", "True"]))
    expected = candidate.strategy_spec(base, micro_batches=base.pipeline.micro_batches)
    got = strategy_spec(cfg)
    for field in ("name", "tensor_parallel", "batch_size", "accum_steps"):
        assert getattr(got, field) == getattr(expected, field), field
    assert got.activation_checkpointing == candidate.act_ckpt
    assert got.hsdp_shard_size == expected.hsdp_shard_size
    if candidate.pipeline_stages:
        assert got.pipeline.stages == candidate.pipeline_stages
        assert got.pipeline.schedule == candidate.pipeline_schedule
    if candidate.zero_stage:
        assert got.deepspeed.zero_stage == candidate.zero_stage
        assert got.deepspeed.offload_optimizer == "cpu"
        assert got.deepspeed.offload_params == "none"


def test_auto_is_checked_as_ddp_until_it_is_planned():
    cfg = load_cfg(None, ["DIST.STRATEGY", "auto", "MODEL.DUMMY_INPUT", "True"])
    assert strategy_spec(cfg).name == "ddp"


def _write_plan(out_dir, text: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, auto.RECORD), "w", encoding="utf-8") as f:
        f.write(text)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('{"keys": {"OUT_DIR": "/"}}', "keys a plan does not set: OUT_DIR"),
        ('{"keys": [1]}', "no 'keys' object"),
        ("[" * 100_000, "recursion"),
        (" " * (auto.MAX_RECORD_BYTES + 1), "larger than"),
    ],
    ids=["foreign key", "no keys", "deep", "huge"],
)
def test_a_crafted_plan_record_is_refused(tmp_path, text, why):
    _write_plan(tmp_path, text)
    with pytest.raises(ConfigError, match="unusable") as error:
        auto.recorded_plan(str(tmp_path))
    assert why in str(error.value)


def test_a_plan_record_that_is_a_pipe_or_a_link_does_not_hang(tmp_path):
    os.mkfifo(tmp_path / auto.RECORD)
    with pytest.raises(ConfigError, match="not a regular file"):
        auto.recorded_plan(str(tmp_path))
    os.remove(tmp_path / auto.RECORD)
    (tmp_path / "elsewhere.json").write_text('{"keys": {}}')
    os.symlink(tmp_path / "elsewhere.json", tmp_path / auto.RECORD)
    with pytest.raises(ConfigError, match="unusable"):
        auto.recorded_plan(str(tmp_path))


@pytest.mark.slow
def test_a_two_rank_dry_run_with_auto_prints_its_choice_and_checks_it(tmp_path):
    out_dir = str(tmp_path / "run")
    result = torchrun(
        2, "--dry-run", *FAST, "DIST.STRATEGY", "auto", "OUT_DIR", out_dir
    )
    assert_ok(result)
    text = result.stdout + result.stderr
    assert "plan (DIST.STRATEGY auto):" in text
    assert re.search(r"chosen: \w+, micro-batch \d+ x \d+", text)
    predicted, measured = (int(x) for x in LINE.search(text).groups())
    assert abs(predicted - measured) <= 0.15 * measured, (predicted, measured)
    assert not os.path.exists(out_dir)  # a dry run writes nothing


@pytest.mark.slow
def test_auto_records_its_plan_and_a_resumed_run_reuses_it(tmp_path):
    out_dir = str(tmp_path / "run")
    first = train_net(*TINY, "DIST.STRATEGY", "auto", "OUT_DIR", out_dir)
    assert_ok(first)
    config = read_text(out_dir, "config.yaml")
    chosen = json.loads(read_text(out_dir, auto.RECORD))
    assert "STRATEGY: auto" not in config
    assert f"STRATEGY: {chosen['keys']['DIST.STRATEGY']}" in config
    assert f"BATCH_SIZE: {chosen['keys']['TRAIN.BATCH_SIZE']}" in config
    (plan,) = read_metrics(out_dir, "plan")
    assert plan["chosen"]["strategy"] == chosen["keys"]["DIST.STRATEGY"]
    assert {"memory_mib", "step_s", "reason"} <= set(plan["candidates"][0])
    assert LINE.search(first.stdout + first.stderr)

    again = train_net(
        *TINY, "DIST.STRATEGY", "auto", "OPTIM.MAX_EPOCH", "2", "OUT_DIR", out_dir
    )
    assert_ok(again)
    assert "DIST.STRATEGY auto ran nothing (resumed)" in again.stdout + again.stderr
    assert "resum" in read_text(out_dir, "log.txt")
    assert json.loads(read_text(out_dir, auto.RECORD)) == chosen
