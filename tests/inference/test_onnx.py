"""ONNX export checked by ONNX Runtime, and ONNX files refused by predict.

Three architectures are exported once each (a module fixture) through
``tools/export.py --onnx``: resnet20 after a few steps on the embedded digits,
torchvision's resnet18 at 32 px and our ViT, both freshly initialised.  The
trained checkpoint of tests/test_tools.py covers predicting with the file.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
from pathlib import Path

import pytest
import torch
from helpers import error_line
from PIL import Image
from torch import nn

from distribuuuu import models
from distribuuuu.config import CHOICES, get_cfg
from distribuuuu.data import build_dataset, build_normalizer
from distribuuuu.engine.specs import data_spec
from distribuuuu.inference import onnx as onnx_model
from distribuuuu.inference.export import validation_batches
from distribuuuu.inference.read import eval_data_spec, inference_spec
from distribuuuu.tools import export as export_tool
from distribuuuu.tools import predict

# The optional packages of the ``onnx`` extra (in ``dev`` too).
onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxscript")
pytest.importorskip("onnxruntime")
TensorProto, helper = onnx.TensorProto, onnx.helper

# arch -> KEY VALUE overrides of the export (a plain state_dict has no cfg).
ARCHS = {
    "resnet20": [],
    "resnet18": ["TRAIN.IM_SIZE", "32", "TEST.IM_SIZE", "32"],
    "vit_tiny_patch4": [],
}
REPORTED = re.compile(
    r"^wrote (\S+) \(ONNX\); max abs difference (\S+) on 64 validation images of "
    r"mnist5k in batches of 32, 31, 1; top-1 agreement (\d+)/64$",
    re.M,
)


def digits_cfg(*opts: str):
    """The default cfg (the embedded digits) with ``opts`` merged."""
    cfg = get_cfg()
    cfg.merge_from_list(list(opts))
    cfg.DATA.NAME = "mnist5k"
    return cfg


def briefly_trained_resnet20(steps: int = 20) -> nn.Module:
    """resnet20 after ``steps`` SGD steps of 64 training digits (seeded)."""
    torch.manual_seed(0)
    cfg = digits_cfg()
    dataset, normalize = (
        build_dataset(data_spec(cfg), train=True),
        build_normalizer(data_spec(cfg), "cpu"),
    )
    model = models.build_model("resnet20", 10).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    order = torch.randperm(len(dataset))
    for step in range(steps):
        batch = [dataset[i] for i in order[step * 64 : (step + 1) * 64].tolist()]
        images = normalize(torch.stack([image for image, _ in batch]))
        labels = torch.tensor([label for _, label in batch])
        loss = nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


@pytest.fixture(scope="module", params=list(ARCHS))
def exported(request, tmp_path_factory):
    """(arch, its eval-mode model, the .onnx path, what export.py printed)."""
    arch = request.param
    folder = tmp_path_factory.mktemp(arch)
    if arch == "resnet20":
        model = briefly_trained_resnet20()
    else:
        torch.manual_seed(0)
        model = models.build_model(arch, 10).eval()
    weights, path = folder / "w.pth", folder / f"{arch}.onnx"
    torch.save(model.state_dict(), weights)
    argv = ["--weights", str(weights), "--out", str(folder / "out.pth")]
    argv += ["--onnx", str(path), "MODEL.ARCH", arch, *ARCHS[arch]]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert export_tool.main(argv) == 0
    return arch, model, path, printed.getvalue()


@pytest.mark.slow
def test_export_passes_the_runtime_check(exported):
    arch, model, path, printed = exported
    (reported,) = REPORTED.findall(printed)
    assert reported[0] == str(path)
    assert float(reported[1]) <= 1e-4 and reported[2] == "64"

    # Checked again here: other validation digits, in a batch of 5.
    session, metadata = onnx_model.load_session(str(path))
    cfg = digits_cfg(*ARCHS[arch])
    (images,), _ = validation_batches(eval_data_spec(cfg), (5,))
    with torch.no_grad():
        expected = model(images)
    logits = onnx_model.run_session(session, images)
    assert logits.shape == (5, 10)
    assert (logits - expected).abs().max() <= 1e-4
    assert torch.equal(logits.argmax(1), expected.argmax(1))


@pytest.mark.slow
def test_export_stores_what_predict_needs(exported):
    arch, _, path, _ = exported
    size = int(dict(zip(*[iter(ARCHS[arch])] * 2)).get("TRAIN.IM_SIZE", 28))
    props = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    assert props["distribuuuu.arch"] == arch
    assert json.loads(props["distribuuuu.classes"]) == [str(d) for d in range(10)]
    assert props["distribuuuu.input_size"] == props["distribuuuu.resize"] == str(size)
    assert json.loads(props["distribuuuu.mean"]) == pytest.approx([0.1307] * 3)
    assert json.loads(props["distribuuuu.std"]) == pytest.approx([0.3081] * 3)
    session, _ = onnx_model.load_session(str(path))
    (given,) = session.get_inputs()
    assert given.shape == ["batch", 3, size, size]


@pytest.mark.slow
def test_predict_uses_the_saved_pipeline(tmp_path: Path, capsys):
    """An ImageNet-style run (resize 36, crop 32, bicubic, PIL decoder) whose
    validation folder is not here: checked on random images, and predict.py
    --onnx transforms a photo as predict.py --weights does."""
    torch.manual_seed(0)
    weights, path = tmp_path / "w.pth", tmp_path / "m.onnx"
    torch.save(models.build_model("resnet8", 4).state_dict(), weights)
    opts = ["MODEL.ARCH", "resnet8", "MODEL.NUM_CLASSES", "4"]
    opts += ["DATA.NAME", "imagefolder", "TEST.DATASET", str(tmp_path / "gone")]
    opts += ["TRAIN.IM_SIZE", "32", "TEST.IM_SIZE", "36"]
    opts += ["TEST.INTERPOLATION", "bicubic", "DATA.DECODER", "pil"]
    argv = ["--weights", str(weights), "--out", str(tmp_path / "o.pth")]
    assert export_tool.main([*argv, "--onnx", str(path), *opts]) == 0
    printed = capsys.readouterr().out
    assert "on 64 random images (the validation set is not readable here" in printed

    photo = tmp_path / "photo.png"
    pixels = torch.randint(0, 256, (45, 60, 3), dtype=torch.uint8).numpy()
    Image.fromarray(pixels, mode="RGB").save(photo)
    args = ["--json", "--topk", "4", str(photo)]
    assert predict.main(["--onnx", str(path), *args]) == 0
    (with_onnx,) = capsys.readouterr().out.splitlines()
    assert (
        predict.main(["--weights", str(weights), "--device", "cpu", *args, *opts]) == 0
    )
    (with_torch,) = capsys.readouterr().out.splitlines()
    onnx_top, torch_top = json.loads(with_onnx)["top"], json.loads(with_torch)["top"]
    assert [e["class"] for e in onnx_top] == [e["class"] for e in torch_top]
    for onnx_entry, torch_entry in zip(onnx_top, torch_top):
        assert abs(onnx_entry["prob"] - torch_entry["prob"]) <= 1e-5
    _, metadata = onnx_model.load_session(str(path))
    assert (metadata.resize, metadata.input_size) == (36, 32)
    assert (metadata.interpolation, metadata.decoder) == ("bicubic", "pil")
    assert metadata.mean == (0.485, 0.456, 0.406)  # ImageNet's


@pytest.mark.parametrize("decoder", CHOICES["DATA.DECODER"])
def test_metadata_holds_every_decoder_a_run_may_use(decoder):
    """A run of any DATA.DECODER exports metadata that reads back, and
    predicts by reading files on the CPU (gpu's pixels there are tensor's)."""
    cfg = get_cfg()
    cfg.DATA.DECODER = decoder
    spec = inference_spec(cfg)
    metadata = onnx_model.OnnxMetadata.from_spec(spec, [str(i) for i in range(10)])
    again = onnx_model.OnnxMetadata.from_props(metadata.to_props(), "m.onnx")
    assert again == metadata and again.decoder == decoder
    expected = "tensor" if decoder == "gpu" else decoder
    assert expected == again.data_spec().decoder


# --------------------------------------------------------------------------- #
# Bad input
# --------------------------------------------------------------------------- #


def fractional_pool_net(num_classes: int) -> nn.Module:
    """A tiny CNN with fractional max pooling (Graham 2014), which torch's
    ONNX exporter cannot lower (aten.fractional_max_pool2d)."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.FractionalMaxPool2d(2, output_size=8),
        nn.Flatten(),
        nn.Linear(8 * 8 * 8, num_classes),
    )


def test_export_names_an_unsupported_operator(tmp_path: Path, capsys, monkeypatch):
    monkeypatch.setitem(models._OWN, "fracpool", fractional_pool_net)
    weights, out, path = tmp_path / "w.pth", tmp_path / "o.pth", tmp_path / "f.onnx"
    torch.save(fractional_pool_net(10).state_dict(), weights)
    argv = ["--weights", str(weights), "--out", str(out), "--onnx", str(path)]
    assert export_tool.main([*argv, "MODEL.ARCH", "fracpool"]) == 2
    line = error_line(capsys)
    assert "fracpool cannot be exported to ONNX" in line
    assert "aten.fractional_max_pool2d" in line
    assert not out.exists() and not path.exists()  # refused before writing


def test_missing_packages_name_the_extra(tmp_path: Path, capsys, monkeypatch):
    weights = tmp_path / "w.pth"
    torch.save(models.build_model("lenet5", 10).state_dict(), weights)
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import fails
    argv = ["--weights", str(weights), "--out", str(tmp_path / "o.pth")]
    assert export_tool.main([*argv, "--onnx", "m.onnx", "MODEL.ARCH", "lenet5"]) == 2
    line = error_line(capsys)
    assert "onnxruntime" in line and "pip install 'distribuuuu[onnx]'" in line
    assert not (tmp_path / "o.pth").exists()
    assert predict.main(["--onnx", str(tmp_path / "m.onnx"), str(weights)]) == 2
    assert "pip install 'distribuuuu[onnx]'" in error_line(capsys)


def tiny_onnx(path: Path, props: dict[str, str], size: int = 2, external=False):
    """An ONNX file: ``images`` N x 3 x size x size -> flattened, times a
    weight -> ``logits`` N x 2, with ``props`` as its metadata."""
    features = 3 * size * size
    weight = helper.make_tensor(
        "w", TensorProto.FLOAT, [features, 2], [0.5] * (features * 2)
    )
    if external:  # the weight read from another file
        weight.ClearField("float_data")
        weight.data_location = TensorProto.EXTERNAL
        weight.external_data.add(key="location", value="/etc/hostname")
    graph = helper.make_graph(
        [
            helper.make_node("Flatten", ["images"], ["flat"]),
            helper.make_node("MatMul", ["flat", "w"], ["logits"]),
        ],
        "tiny",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, [None, 3, 2, 2])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [None, 2])],
        [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    helper.set_model_props(model, props)
    path.write_bytes(model.SerializeToString())
    return path


GOOD_PROPS = {
    "distribuuuu.arch": "tiny",
    "distribuuuu.classes": '["cat", "dog"]',
    "distribuuuu.data_name": "synthetic",
    "distribuuuu.input_size": "2",
    "distribuuuu.resize": "2",
    "distribuuuu.interpolation": "bilinear",
    "distribuuuu.decoder": "tensor",
    "distribuuuu.mean": "[0.5, 0.5, 0.5]",
    "distribuuuu.std": "[0.25, 0.25, 0.25]",
}


def test_predict_refuses_bad_onnx_files(tmp_path: Path, capsys):
    image = tmp_path / "a.png"
    Image.new("RGB", (7, 5), (200, 100, 0)).save(image)
    good = tiny_onnx(tmp_path / "good.onnx", GOOD_PROPS)
    assert predict.main(["--onnx", str(good), "--json", str(image)]) == 0
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [entry["class"] for entry in record["top"]] == ["cat", "dog"]
    assert record["top"][0]["prob"] == pytest.approx(0.5)

    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x08\x07 this is not a protobuf \xff\xff")
    text = tmp_path / "notes.onnx"
    text.write_text("hello\n")

    def with_props(name: str, **changed: str) -> Path:
        props = {**GOOD_PROPS, **{f"distribuuuu.{k}": v for k, v in changed.items()}}
        return tiny_onnx(tmp_path / name, props)

    foreign = tiny_onnx(tmp_path / "foreign.onnx", {})
    cases = {
        tmp_path / "missing.onnx": "no such file",
        garbage: "not an ONNX model",
        text: "not an ONNX model",
        foreign: "no distribuuuu.arch in its metadata",
        with_props("c.onnx", classes='{"a": 1}'): "classes is not a list",
        with_props("n.onnx", classes="[" * 100_000): "classes is not valid JSON",
        with_props("s.onnx", input_size="1e9"): "input_size '1e9' is not a size",
        with_props("d.onnx", std="[0, 1, 1]"): "std is not 3 numbers",
        with_props("i.onnx", interpolation="__import__('os')"): "interpolation",
        with_props("k.onnx", classes='["a", "b", "c"]'): "N x 3 logits",
        tiny_onnx(tmp_path / "x.onnx", GOOD_PROPS, external=True): "other files",
    }
    for path, words in cases.items():
        assert predict.main(["--onnx", str(path), str(image)]) == 2, path
        line = error_line(capsys)
        assert str(path) in line and words in line, line
    with pytest.raises(SystemExit, match="2"):
        predict.main(["--onnx", str(good), "--cfg", "x.yaml", str(image)])
    assert "--onnx takes no --cfg" in capsys.readouterr().err


def test_a_model_is_always_read_as_onnx(tmp_path: Path, capsys):
    """ONNX Runtime takes bytes whose 4th to 8th read "ORTM" for its own
    flatbuffer format, so it would run another model than the one checked;
    it is told to read ONNX.  Here the doc string of a good model says so."""
    image = tmp_path / "a.png"
    Image.new("RGB", (7, 5), (200, 100, 0)).save(image)
    path = tiny_onnx(tmp_path / "m.onnx", GOOD_PROPS)
    path.write_bytes(b"\x32\x06xxORTM" + path.read_bytes())  # field 6: doc_string
    assert onnx.load(str(path)).doc_string == "xxORTM"
    assert predict.main(["--onnx", str(path), "--json", str(image)]) == 0
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [entry["class"] for entry in record["top"]] == ["cat", "dog"]
