"""Multi-label acceptance: on mnist5k_pairs (config/mnist5k_multilabel.yaml)
bce and asl each reach 90% mAP, and the mAP of the gathered scores is
scikit-learn's, the same on 1, 2 and 3 ranks."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from helpers import REPO, assert_ok, import_tool, read_metrics, torchrun, train_net

CONFIG = os.path.join(REPO, "config", "mnist5k_multilabel.yaml")

# Two training runs of the recipe (about 30 s each), shared by the tests.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["bce", "asl"])
def trained(request, tmp_path_factory) -> tuple[str, str]:
    """One run per loss with the recipe's defaults: (loss, OUT_DIR)."""
    out = str(tmp_path_factory.mktemp(f"multilabel_{request.param}"))
    assert_ok(train_net("--cfg", CONFIG, "MODEL.LOSS", request.param, "OUT_DIR", out))
    return request.param, out


def test_each_sigmoid_loss_reaches_90_map(trained):
    loss, out = trained
    last = read_metrics(out, "val")[-1]
    assert last["map"] >= 90.0, (loss, last)
    assert "top1" not in last and len(last["per_class_ap"]) == 10
    assert 0 <= last["f1_macro"] <= 100 and 0 <= last["f1_micro"] <= 100
    saved = torch.load(os.path.join(out, "best.pth"), weights_only=True)
    assert saved["loss"] == loss and "map" in saved


def _gathered_scores(out: str) -> tuple[np.ndarray, np.ndarray]:
    """The best weights' probabilities and targets over the validation set,
    computed here in one process: the scores the evaluation gathers."""
    from distribuuuu.config import get_cfg, merge_from_file
    from distribuuuu.data import build_dataset, build_normalizer
    from distribuuuu.engine import specs
    from distribuuuu.inference.read import load_for_inference

    cfg = get_cfg()
    merge_from_file(cfg, os.path.join(out, "config.yaml"))
    data = specs.data_spec(cfg)
    val_set = build_dataset(data, train=False)
    model, _, _ = load_for_inference(os.path.join(out, "best.pth"))
    normalize = build_normalizer(data, torch.device("cpu"))
    images, targets = zip(*(val_set[i] for i in range(len(val_set))))
    with torch.no_grad():
        batch = normalize(torch.stack(images))
        scores = torch.sigmoid(model(batch).float())
    return scores.double().numpy(), torch.stack(targets).numpy()


def test_distributed_map_is_scikit_learn_s_on_every_world_size(trained, tmp_path):
    metrics = pytest.importorskip("sklearn.metrics")
    loss, out = trained
    if loss != "bce":
        pytest.skip("one loss's checkpoint is enough")
    weights = os.path.join(out, "best.pth")
    found = {}
    for ranks in (1, 2, 3):
        into = str(tmp_path / f"eval{ranks}")
        args = ["--eval-only", "--cfg", CONFIG, "MODEL.LOSS", "bce"]
        args += ["MODEL.WEIGHTS", weights, "OUT_DIR", into]
        result = train_net(*args) if ranks == 1 else torchrun(ranks, *args)
        assert_ok(result)
        found[ranks] = read_metrics(into, "val")[-1]
    scores, targets = _gathered_scores(out)
    reference = 100 * metrics.average_precision_score(targets, scores, average="macro")
    for ranks, record in found.items():
        assert record["samples"] == len(scores), ranks
        assert record["map"] == pytest.approx(reference, abs=1e-4), ranks  # percent
        assert record["map"] == pytest.approx(found[1]["map"], abs=1e-4), ranks


def test_predict_prints_label_sets_from_the_weights_and_the_onnx_export(
    trained, tmp_path, capsys
):
    """predict.py reads the loss kind from best.pth and from the ONNX
    metadata: both print each image's classes at or above TEST.THRESHOLD,
    the same sets, not a softmax top-k."""
    loss, out = trained
    if loss != "bce":
        pytest.skip("one loss's checkpoint is enough")
    from PIL import Image

    from distribuuuu.data.pairs import load_mnist5k_pairs

    images, targets = load_mnist5k_pairs(False)
    paths = [str(tmp_path / f"pair{i}.png") for i in range(16)]
    for i, path in enumerate(paths):
        Image.fromarray(images[i, 0].numpy()).save(path)
    weights, onnx_file = os.path.join(out, "best.pth"), str(tmp_path / "m.onnx")
    assert import_tool("export").main(["--weights", weights, "--onnx", onnx_file]) == 0
    found = {}
    for source in (["--weights", weights], ["--onnx", onnx_file]):
        capsys.readouterr()
        assert import_tool("predict").main([*source, "--json", *paths]) == 0
        lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        found[source[0]] = [{c["class"] for c in line["top"]} for line in lines]
        assert all(c["prob"] >= 0.5 for line in lines for c in line["top"])
    assert found["--weights"] == found["--onnx"]
    truth = [{str(c) for c in row.nonzero().flatten().tolist()} for row in targets]
    assert sum(s == t for s, t in zip(found["--onnx"], truth)) >= 8  # most sets
