"""predict of a sigmoid model (MODEL.LOSS bce / asl): the labels at or above
TEST.THRESHOLD, known from the weights file or the ONNX metadata; older files
without the record mean softmax (ce)."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from distribuuuu import models
from distribuuuu.checkpoint.format import best_weights, saved_loss
from distribuuuu.config import get_cfg
from distribuuuu.errors import OnnxError
from distribuuuu.inference import onnx as onnx_model
from distribuuuu.inference.predict import classify_images, labels_above
from distribuuuu.inference.read import inference_spec


def test_labels_above_the_threshold_most_probable_first():
    logits = torch.tensor([[2.0, -3.0, 0.5, 0.0], [-4.0, -4.0, -4.0, -4.0]])
    found = labels_above(lambda images: images, logits, 0.5)
    assert [label for label, _ in found[0]] == [0, 2, 3]  # sigmoid(0) = 0.5 counts
    assert found[0][0][1] == pytest.approx(torch.sigmoid(torch.tensor(2.0)).item())
    assert found[1] == []  # no class reaches it: no label


def _weights(tmp_path, loss: str | None) -> str:
    """best.pth of an untrained resnet8 on 10 classes whose last layer
    scores class 3 high and the rest low, recorded with ``loss`` (None: a
    file from before the loss was recorded)."""
    cfg = get_cfg()
    cfg.MODEL.ARCH = "resnet8"
    model = models.build_model("resnet8", 10)
    head = model.fc if hasattr(model, "fc") else list(model.modules())[-1]
    with torch.no_grad():
        head.weight.zero_()
        head.bias.copy_(torch.full((10,), -5.0))
        head.bias[3], head.bias[7] = 5.0, 4.0
    score = ("top1", 50.0)
    kwargs = {} if loss is None else {"loss": loss}
    state = best_weights(
        model.state_dict(),
        epoch=1,
        score=score,
        classes=[f"c{i}" for i in range(10)],
        arch="resnet8",
        config_dump=cfg.dump(),
        **kwargs,
    )
    if loss is None:
        del state["loss"]
    path = tmp_path / "best.pth"
    torch.save(state, path)
    Image.new("RGB", (32, 32), (90, 90, 90)).save(tmp_path / "x.png")
    return str(path)


def test_predict_of_a_bce_model_prints_its_labels(tmp_path):
    weights = _weights(tmp_path, "bce")
    [(path, labels)] = classify_images(weights, [str(tmp_path / "x.png")])
    assert [name for name, _ in labels] == ["c3", "c7"]
    assert all(prob >= 0.5 for _, prob in labels)
    opts = ["TEST.THRESHOLD", "0.99"]  # sigmoid(4) = 0.982: c7 drops out
    [(_, labels)] = classify_images(weights, [str(tmp_path / "x.png")], opts=opts)
    assert [name for name, _ in labels] == ["c3"]


def test_weights_without_a_recorded_loss_are_softmax(tmp_path):
    weights = _weights(tmp_path, None)
    [(_, top)] = classify_images(weights, [str(tmp_path / "x.png")], topk=3)
    assert len(top) == 3 and sum(prob for _, prob in top) <= 1.0 + 1e-6
    assert saved_loss({}) == "ce" and saved_loss({"loss": "asl"}) == "asl"


def test_onnx_metadata_carries_the_loss_and_old_files_mean_ce():
    cfg = get_cfg()
    cfg.MODEL.LOSS, cfg.TEST.THRESHOLD = "asl", 0.3
    spec = inference_spec(cfg)
    metadata = onnx_model.OnnxMetadata.from_spec(spec, [str(i) for i in range(10)])
    props = metadata.to_props()
    again = onnx_model.OnnxMetadata.from_props(props, "m.onnx")
    assert (again.loss, again.threshold) == ("asl", 0.3)
    old = {k: v for k, v in props.items() if not k.endswith(("loss", "threshold"))}
    assert onnx_model.OnnxMetadata.from_props(old, "m.onnx").loss == "ce"
    bad = {**props, "distribuuuu.threshold": "nan"}
    with pytest.raises(OnnxError, match="threshold"):
        onnx_model.OnnxMetadata.from_props(bad, "m.onnx")
