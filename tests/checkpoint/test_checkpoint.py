"""Checkpoint files: atomic writes, the last pointer, keep-N, safe loading."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from distribuuuu import checkpoint as cp
from distribuuuu.checkpoint.format import capture_rng_state, restore_rng_state
from distribuuuu.errors import RefusedCheckpointError


def _state(epoch: int) -> dict:
    return {"model": {"w": torch.full((3,), float(epoch))}, "epoch": epoch}


def test_save_moves_last_and_keeps_newest(tmp_path):
    for epoch in range(1, 12):
        cp.save_checkpoint(str(tmp_path), epoch, _state(epoch), cp.Retention(keep=3))
    names = sorted(os.listdir(tmp_path / "checkpoints"))
    assert names == ["ckpt_ep_0009.pth", "ckpt_ep_0010.pth", "ckpt_ep_0011.pth", "last"]
    assert (tmp_path / "checkpoints" / "last").read_text().strip() == "ckpt_ep_0011.pth"
    path, state = cp.find_resume_checkpoint(str(tmp_path))
    assert path.endswith("ckpt_ep_0011.pth") and state["epoch"] == 11


@pytest.mark.parametrize(
    "lower, kept",
    [(False, [2, 4, 6]), (True, [1, 3, 6])],
    ids=["top1", "loss"],
)
def test_keep_best_keeps_the_best_scores_besides_the_newest(tmp_path, lower, kept):
    scores = [50.0, 90.0, 60.0, 95.0, 70.0, 65.0]  # epochs 1-6
    retention = cp.Retention(keep=2, best=2, lower_is_better=lower)
    for epoch, score in enumerate(scores, 1):
        cp.save_checkpoint(str(tmp_path), epoch, _state(epoch), retention, 0, score)
        # an iteration checkpoint between (no evaluation, no score)
        cp.save_checkpoint(str(tmp_path), epoch, _state(epoch), retention, 3)
    names = sorted(os.listdir(tmp_path / "checkpoints"))
    expected = [f"ckpt_ep_{e:04d}.pth" for e in kept]
    # the newest two (epoch 6 and 3 steps after it) and the best two
    assert names == sorted(
        [*expected, "ckpt_ep_0006_it_0003.pth", "last", "scores.json"]
    )
    assert (tmp_path / "checkpoints" / "last").read_text().strip() == (
        "ckpt_ep_0006_it_0003.pth"
    )
    left = cp.files.read_scores(str(tmp_path / "checkpoints"))
    assert sorted(left) == expected  # the pruned ones' scores are gone


def test_a_damaged_scores_file_keeps_only_the_newest(tmp_path):
    retention = cp.Retention(keep=1, best=3)
    cp.save_checkpoint(str(tmp_path), 1, _state(1), retention, 0, 90.0)
    (tmp_path / "checkpoints" / "scores.json").write_text('{"ckpt_ep_0001.pth": "x"')
    cp.save_checkpoint(str(tmp_path), 2, _state(2), retention, 0, 10.0)
    names = sorted(os.listdir(tmp_path / "checkpoints"))
    assert names == ["ckpt_ep_0002.pth", "last", "scores.json"]


def test_numbers_sort_as_numbers_not_text(tmp_path):
    cp.save_checkpoint(str(tmp_path), 9, _state(9))
    cp.save_checkpoint(str(tmp_path), 10000, _state(10000))
    cp.save_checkpoint(str(tmp_path), 9, _state(9), step=30)
    positions = [p for p, _ in cp.list_checkpoints(str(tmp_path))]
    assert positions == [(10000, 0), (9, 30), (9, 0)]


def test_truncated_newest_is_skipped(tmp_path, caplog):
    cp.save_checkpoint(str(tmp_path), 1, _state(1))
    newest = cp.save_checkpoint(
        str(tmp_path), 2, {**_state(2), "pad": torch.zeros(10000)}
    )
    size = os.path.getsize(newest)
    with open(newest, "r+b") as f:
        f.truncate(size // 2)
    path, state = cp.find_resume_checkpoint(str(tmp_path))
    assert state["epoch"] == 1
    assert "ckpt_ep_0002.pth" in caplog.text


def test_loading_refuses_pickled_code(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    path = tmp_path / "evil.pth"
    torch.save({"model": Evil()}, path)
    with pytest.raises(RefusedCheckpointError, match="pickled code.*system"):
        cp.load_file(str(path))


def test_module_prefix_is_ignored_and_mismatch_named():
    model = torch.nn.Sequential(torch.nn.Linear(2, 3))
    wrapped = {f"module.{k}": v for k, v in model.state_dict().items()}
    other = torch.nn.Sequential(torch.nn.Linear(2, 3))
    cp.load_model_weights(other, {"model": wrapped}, "x.pth")
    assert torch.equal(other[0].weight, model[0].weight)
    with pytest.raises(ValueError, match="0.weight has shape"):
        cp.load_model_weights(
            torch.nn.Sequential(torch.nn.Linear(2, 4)), wrapped, "x.pth"
        )


def test_rng_state_round_trip(tmp_path):
    state = capture_rng_state()
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    path = str(tmp_path / "rng.pth")
    cp.save_weights(path, {"rng": state})
    restore_rng_state(cp.load_file(path)["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
