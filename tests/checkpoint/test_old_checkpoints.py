"""Checkpoints written by the code before the strategy refactor (issue 17) resume
under today's code and continue exactly as the old code continued them.

tests/fixtures/checkpoints_5f701c2 holds epoch 1 of a LeNet-5 run with an EMA,
once whole (one process) and once sharded (FSDP, 2 processes), and the val and
val_ema records of epoch 2 (expected.json).  The old code wrote them; when the
synthetic images changed (issue 36), today's code first reproduced those
values with the old images, then the records were taken again with the new
ones (the old ones are kept beside them).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from helpers import REPO, assert_ok, read_metrics, train_net

FIXTURES = os.path.join(REPO, "tests", "fixtures", "checkpoints_5f701c2")


def _expected() -> dict:
    with open(os.path.join(FIXTURES, "expected.json")) as f:
        return json.load(f)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, launch",
    [("whole", []), ("fsdp", ["--num-procs", "2", "DIST.STRATEGY", "fsdp"])],
)
def test_old_checkpoint_resumes_and_continues_as_before(tmp_path, kind, launch):
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(os.path.join(FIXTURES, kind), checkpoints)
    (checkpoints / "last").write_text("ckpt_ep_0001.pth\n")
    expected = _expected()
    result = train_net(*launch, *expected["opts"], "OUT_DIR", str(tmp_path))
    assert_ok(result)
    assert "resumed from" in result.stdout + result.stderr
    records = read_metrics(str(tmp_path))
    got = [r for r in records if r.get("split") in ("val", "val_ema")]
    assert [(r["split"], r["epoch"]) for r in got] == [("val", 2), ("val_ema", 2)]
    for new, old in zip(got, expected["epoch_2"][kind]):
        assert new["samples"] == old["samples"]
        assert new["top1"] == pytest.approx(old["top1"], abs=1e-9)
        assert new["topk"] == pytest.approx(old["topk"], abs=1e-9)
        assert new["loss"] == pytest.approx(old["loss"], rel=1e-5)
