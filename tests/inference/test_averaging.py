"""tools/average_checkpoints.py: the mean of the weights, in a file every tool
reads."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import assert_ok, read_metrics, train_net

from distribuuuu import checkpoint as cp
from distribuuuu.checkpoint.format import best_weights
from distribuuuu.inference.average import average_checkpoints, select_checkpoints
from distribuuuu.inference.read import read_checkpoint
from distribuuuu.models import build_model
from distribuuuu.tools import average_checkpoints as tool
from distribuuuu.tools import inspect_ckpt


def _checkpoint(path, epoch: int, seed: int) -> dict:
    """A training checkpoint of resnet8 with weights from ``seed``."""
    torch.manual_seed(seed)
    model = build_model("resnet8", 10)
    for module in model.modules():  # running statistics that differ too
        if isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean.normal_()
            module.num_batches_tracked.fill_(epoch * 10)
    from distribuuuu.config import get_cfg

    cfg = get_cfg()
    cfg.MODEL.ARCH = "resnet8"
    state = best_weights(
        model.state_dict(),
        epoch=epoch,
        score=("top1", 50.0),
        classes=list("0123456789"),
        arch=cfg.MODEL.ARCH,
        config_dump=cfg.dump(),
    )
    torch.save(state, path)
    return model.state_dict()


def test_the_average_is_the_mean_and_integers_come_from_the_newest(tmp_path):
    paths = [str(tmp_path / f"{n}.pth") for n in range(3)]
    weights = [_checkpoint(p, epoch, seed) for p, epoch, seed in
               zip(paths, (3, 1, 2), (0, 1, 2))]  # fmt: skip
    averaged = average_checkpoints(paths)
    assert averaged["epoch"] == 3 and averaged["arch"] == "resnet8"
    assert averaged["averaged_from"] == ["0.pth", "1.pth", "2.pth"]
    model = averaged["model"]
    for key, value in weights[0].items():
        if value.is_floating_point():
            mean = torch.stack([w[key].double() for w in weights]).mean(0)
            torch.testing.assert_close(model[key], mean.float(), rtol=0, atol=1e-7)
        else:  # num_batches_tracked: the newest (epoch 3)
            assert torch.equal(model[key], weights[0][key])
    out = str(tmp_path / "avg.pth")
    assert tool.main(["--out", out, *paths]) == 0
    assert read_checkpoint(out).weights.keys() == model.keys()
    assert inspect_ckpt.main([out]) == 0


def test_checkpoints_of_different_models_exit_2(tmp_path, capsys):
    small = str(tmp_path / "a.pth")
    _checkpoint(small, 1, 0)
    other = str(tmp_path / "b.pth")
    torch.save(build_model("lenet5", 10).state_dict(), other)
    assert tool.main(["--out", str(tmp_path / "avg.pth"), small, other]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "differ from those of" in err
    assert tool.main(["--out", str(tmp_path / "avg.pth"), small]) == 2
    assert not os.path.exists(tmp_path / "avg.pth")


@pytest.mark.slow
def test_keep_best_and_averaging_the_best_of_a_run(tmp_path):
    """A 4-epoch run (LeNet-5 on the digits, about 2.5 s an epoch here)
    keeping the newest 1 and the best 2 by top-1; the two best averaged
    evaluate with --eval-only."""
    out = str(tmp_path / "run")
    keys = ["MODEL.ARCH", "lenet5", "OPTIM.MAX_EPOCH", "4", "CHECKPOINT.KEEP", "1"]
    keys += ["CHECKPOINT.KEEP_BEST", "2", "OUT_DIR", out]
    assert_ok(train_net(*keys))
    records = {r["epoch"]: r["top1"] for r in read_metrics(out, "val")}
    best = sorted(records, key=lambda e: records[e], reverse=True)[:2]
    kept = {cp.checkpoint_name(e) for e in {4, *best}}
    names = set(os.listdir(os.path.join(out, "checkpoints")))
    assert names == kept | {"last", "scores.json"}
    paths = select_checkpoints(out, best=2)
    assert sorted(os.path.basename(p) for p in paths) == sorted(
        cp.checkpoint_name(e) for e in best
    )
    averaged = str(tmp_path / "avg.pth")
    assert tool.main(["--out", averaged, "--run", out, "--best", "2"]) == 0
    result = train_net("--eval-only", "MODEL.ARCH", "lenet5", "MODEL.WEIGHTS",
                       averaged, "OUT_DIR", str(tmp_path / "eval"))  # fmt: skip
    assert_ok(result)
    assert "samples 1000" in result.stdout
