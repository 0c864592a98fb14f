"""N processes compute what one would: accumulation, exact evaluation,
determinism and mixed precision, through the real entry point on CPU."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import assert_ok, read_metrics, read_text, torchrun, train_net

# A model without BatchNorm on small synthetic data: 512 training images.
NO_BN = [
    "MODEL.ARCH",
    "lenet5",
    "MODEL.DUMMY_INPUT",
    "True",
    "TRAIN.IM_SIZE",
    "28",
    "TEST.IM_SIZE",
    "28",
    "DATA.SYNTHETIC_SIZE",
    "[512, 101]",
    "OPTIM.MAX_EPOCH",
    "2",
    "OPTIM.WARMUP_EPOCHS",
    "0.5",
    "TRAIN.PRINT_FREQ",
    "2",
]


def _final_weights(out_dir: str) -> dict:
    last = read_text(out_dir, "checkpoints", "last").strip()
    path = os.path.join(out_dir, "checkpoints", last)
    return torch.load(path, weights_only=True)["model"]


def _schedule(out_dir: str) -> list[tuple]:
    return [(r["epoch"], r["iter"], r["lr"]) for r in read_metrics(out_dir, "train")]


def _launch(nproc: int, *args: str):
    return train_net(*args) if nproc == 1 else torchrun(nproc, *args)


@pytest.mark.slow
def test_accumulation_equals_the_large_batch(tmp_path):
    """On 2 processes, where DDP must not all-reduce the accumulating steps."""
    nproc = 2
    big, small = str(tmp_path / "big"), str(tmp_path / "small")
    per_rank = 128 // nproc
    assert_ok(_launch(nproc, *NO_BN, "TRAIN.BATCH_SIZE", str(per_rank), "OUT_DIR", big))
    assert_ok(
        _launch(
            nproc,
            *NO_BN,
            "TRAIN.BATCH_SIZE",
            str(per_rank // 4),
            "TRAIN.ACCUM_STEPS",
            "4",
            "OUT_DIR",
            small,
        )
    )
    expected, actual = _final_weights(big), _final_weights(small)
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=1e-4, atol=1e-6)
    # Same number of optimizer steps (4 per epoch) and the same logged schedule.
    assert _schedule(big) == _schedule(small) and _schedule(big)[-1][:2] == (2, 4)


@pytest.fixture(scope="module")
def one_epoch_run(tmp_path_factory) -> str:
    """OUT_DIR of one epoch of NO_BN, single process."""
    out = str(tmp_path_factory.mktemp("one_epoch"))
    assert_ok(train_net(*NO_BN, "OPTIM.MAX_EPOCH", "1", "OUT_DIR", out))
    return out


@pytest.mark.slow
def test_evaluation_is_exact_for_1_2_3_processes(tmp_path, one_epoch_run):
    weights = os.path.join(one_epoch_run, "best.pth")
    records = []
    for nproc in (1, 2, 3):
        out = str(tmp_path / f"eval{nproc}")
        assert_ok(
            _launch(
                nproc,
                "--eval-only",
                *NO_BN,
                "MODEL.WEIGHTS",
                weights,
                "TEST.BATCH_SIZE",
                "16",
                "OUT_DIR",
                out,
            )
        )
        (record,) = read_metrics(out, "val")
        records.append(record)
    assert [r["world_size"] for r in records] == [1, 2, 3]
    for record in records:
        assert record["samples"] == 101  # divisible by neither 2 nor 3
        assert (record["top1"], record["topk"]) == (
            records[0]["top1"],
            records[0]["topk"],
        )
        assert record["loss"] == pytest.approx(records[0]["loss"], rel=1e-6)


@pytest.mark.slow
def test_same_seed_same_bits_other_seed_other_bits(tmp_path):
    args = "MODEL.ARCH resnet8 MODEL.DUMMY_INPUT True DATA.SYNTHETIC_SIZE [512,101] "
    args += "TRAIN.IM_SIZE 28 TEST.IM_SIZE 28 OPTIM.MAX_EPOCH 1 TRAIN.WORKERS 2"
    args = args.split()
    runs, stdout = {}, {}
    for name, seed in (("a", "0"), ("b", "0"), ("random", "None")):
        out = str(tmp_path / name)
        result = train_net(*args, "RNG_SEED", seed, "OUT_DIR", out)
        assert_ok(result)
        runs[name], stdout[name] = _final_weights(out), result.stdout
    assert all(torch.equal(runs["a"][k], runs["b"][k]) for k in runs["a"])
    assert not all(torch.equal(runs["a"][k], runs["random"][k]) for k in runs["a"])
    assert "seed 0" in read_text(str(tmp_path / "a"), "log.txt")
    assert "(picked at random)" in stdout["random"]


@pytest.mark.slow
def test_mixed_precision_trains_and_resumes_on_cpu(tmp_path):
    """An epoch in bf16, then one asking for fp16, which CPUs run in bf16."""
    args = [*NO_BN, "OUT_DIR", str(tmp_path)]
    assert_ok(train_net(*args, "OPTIM.MAX_EPOCH", "1", "TRAIN.MIXED_PRECISION", "bf16"))
    result = train_net(*args, "TRAIN.MIXED_PRECISION", "fp16")
    assert_ok(result)
    assert "resumed from" in result.stdout
    assert "fp16 on cpu: using bf16 instead" in result.stdout
    val = read_metrics(str(tmp_path), "val")
    assert [r["epoch"] for r in val] == [1, 2] and val[-1]["samples"] == 101
    state = torch.load(
        os.path.join(tmp_path, "checkpoints", "ckpt_ep_0002.pth"), weights_only=True
    )
    assert "scaler" in state


@pytest.mark.slow
def test_gradient_clipping_changes_the_update(tmp_path, one_epoch_run):
    clipped = str(tmp_path / "clipped")
    args = [*NO_BN, "OPTIM.MAX_EPOCH", "1", "OPTIM.CLIP_GRAD_NORM", "0.01"]
    assert_ok(train_net(*args, "OUT_DIR", clipped))
    a, b = _final_weights(one_epoch_run), _final_weights(clipped)
    assert not all(torch.equal(a[k], b[k]) for k in a)
