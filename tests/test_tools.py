"""The checkpoint tools: inspect, export and predict with trained weights.

One tiny model is trained per module; each tool runs once as a subprocess, as
a user runs it, and its other cases call the tool's ``main`` in-process.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
from pathlib import Path

import pytest
import torch
import torchvision
from helpers import (
    FAST,
    REPO,
    assert_ok,
    error_line,
    read_metrics,
    run_python,
    train_net,
)
from PIL import Image

from distribuuuu.data import build_dataset, build_normalizer
from distribuuuu.data.datasets import load_mnist5k
from distribuuuu.engine.specs import data_spec
from distribuuuu.inference import export as exporting
from distribuuuu.inference.read import (
    build_inference_model,
    inference_cfg,
    read_checkpoint,
)
from distribuuuu.models import build_model
from distribuuuu.tools import export as export_tool
from distribuuuu.tools import inspect_ckpt, predict

# One epoch of resnet8 on the embedded digits, about 90% top-1 in 15 s on 2
# cores (no warm-up and batch 32, so that one epoch is enough); a checkpoint
# after 100 of its 125 steps too.
ONE_EPOCH = [
    *FAST,
    *("OPTIM.MAX_EPOCH", "1", "OPTIM.WARMUP_EPOCHS", "0", "TRAIN.BATCH_SIZE", "32"),
    *("CHECKPOINT.PERIOD_ITERS", "100"),
]
DIGITS = range(6)  # the classes of the images that predict.py is given


def tool(name: str, *args: str):
    """``python tools/NAME ARGS`` as a user runs it."""
    return run_python([os.path.join(REPO, "tools", name), *args], timeout=120)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """OUT_DIR of the one-epoch run: checkpoints, best.pth, metrics."""
    out = tmp_path_factory.mktemp("tools") / "out"
    assert_ok(train_net(*ONE_EPOCH, "OUT_DIR", str(out)))
    return out


def reference(path: Path):
    """The model and cfg of a weights file, as the library loads them."""
    ckpt = read_checkpoint(str(path))
    cfg = inference_cfg(ckpt)
    return build_inference_model(ckpt, cfg), cfg


# --------------------------------------------------------------------------- #
# inspect_ckpt.py
# --------------------------------------------------------------------------- #


@pytest.mark.slow
def test_inspect_training_checkpoint(trained: Path):
    path = trained / "checkpoints" / "ckpt_ep_0000_it_0100.pth"
    result = tool("inspect_ckpt.py", str(path))
    assert_ok(result)
    fields = dict(re.findall(r"^(\S+(?: \S+)?) {2,}(.+)$", result.stdout, re.M))
    parameters = sum(p.numel() for p in build_model("resnet8", 10).parameters())
    state = torch.load(path, weights_only=True)
    assert fields["kind"] == "training checkpoint"
    assert fields["arch"] == "resnet8"
    assert fields["epoch"] == "0" and fields["iteration"] == "100"
    assert fields["world size"] == "1" and fields["global batch"] == "32"
    assert fields["classes"] == "10: " + ", ".join(str(d) for d in range(10))
    assert fields["tensors"] == str(len(state["model"]))
    assert fields["parameters"] == f"{parameters:,}"
    dtypes = [str(t.dtype).removeprefix("torch.") for t in state["model"].values()]
    counts = {name: dtypes.count(name) for name in dict.fromkeys(dtypes)}
    assert fields["dtypes"] == ", ".join(f"{k} x {n}" for k, n in counts.items())
    assert "  MODEL.ARCH: resnet8 (default: resnet20)" in result.stdout
    assert "  OPTIM.MAX_EPOCH: 1 (default: 10)" in result.stdout
    assert "  TRAIN.BATCH_SIZE: 32 (default: 64)" in result.stdout


def test_inspect_json_of_best_weights(trained: Path, capsys):
    assert inspect_ckpt.main([str(trained / "best.pth"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    val = read_metrics(str(trained), "val")[-1]
    assert info["kind"] == "best weights"
    assert info["epoch"] == 1 and info["top1"] == val["top1"] > 85
    assert info["classes"] == [str(d) for d in range(10)]
    diff = {d["key"]: (d["value"], d["default"]) for d in info["cfg_diff"]}
    assert diff["MODEL.ARCH"] == ("resnet8", "resnet20")
    assert diff["OUT_DIR"] == (str(trained), "./exp")


def test_inspect_older_files(tmp_path: Path, capsys):
    """No saved classes, keys unknown today, a plain state_dict with ``module.``."""
    weights = build_model("resnet8", 12).state_dict()
    old = tmp_path / "old.pth"
    cfg = "MODEL:\n  ARCH: resnet8\n  NUM_CLASSES: 12\n  GONE: 3\nOLD:\n  KEY: x\n"
    torch.save({"model": weights, "optimizer": {}, "epoch": 4, "cfg": cfg}, old)
    assert inspect_ckpt.main([str(old), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "training checkpoint" and info["epoch"] == 4
    assert info["classes"] == [str(label) for label in range(12)]
    unknown = {d["key"] for d in info["cfg_diff"] if not d["known"]}
    assert unknown == {"MODEL.GONE", "OLD.KEY"}

    plain = tmp_path / "plain.pth"
    torch.save({f"module.{k}": v for k, v in weights.items()}, plain)
    assert inspect_ckpt.main([str(plain)]) == 0
    text = capsys.readouterr().out
    assert "kind          plain state_dict" in text
    assert "cfg           none saved" in text
    assert f"tensors       {len(weights)}" in text


class _RunsCode:
    """Pickles as a call of ``open(marker, "w")``: code that weights_only refuses."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_inspect_rejects_bad_files(tmp_path: Path, capsys):
    text = tmp_path / "notes.pth"
    text.write_text("not a checkpoint\n")
    numbers = tmp_path / "numbers.pth"
    torch.save([1, 2, 3], numbers)
    marker = tmp_path / "ran"
    code = tmp_path / "code.pth"
    torch.save({"model": {"w": torch.ones(1)}, "hook": _RunsCode(marker)}, code)
    cases = {
        tmp_path / "missing.pth": "no such file",
        text: "not a checkpoint torch can read",
        numbers: "not a checkpoint or state_dict",
        code: "refused to load it: it holds pickled code",
    }
    for path, words in cases.items():
        assert inspect_ckpt.main([str(path)]) == 2
        line = error_line(capsys)
        assert str(path) in line and words in line
    assert not marker.exists()


# --------------------------------------------------------------------------- #
# export.py
# --------------------------------------------------------------------------- #


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:FutureWarning")
def test_export_trained_checkpoint(trained: Path, tmp_path: Path):
    weights = trained / "checkpoints" / "ckpt_ep_0001.pth"
    out, script, program = tmp_path / "r8.pth", tmp_path / "r8.ts", tmp_path / "r8.pt2"
    result = tool(
        "export.py",
        *("--weights", str(weights), "--out", str(out)),
        *("--torchscript", str(script), "--torch-export", str(program)),
    )
    assert_ok(result)
    assert len(re.findall(r"^wrote .+ max abs difference", result.stdout, re.M)) == 3

    model, cfg = reference(weights)
    state = torch.load(out, weights_only=True)
    plain = build_model("resnet8", 10)
    assert list(state) == list(plain.state_dict())  # no module., no optimizer
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in state.values())
    plain.load_state_dict(state)
    images = torch.stack(
        [build_dataset(data_spec(cfg), train=False)[i][0] for i in range(8)]
    )
    images = build_normalizer(data_spec(cfg), torch.device("cpu"))(images)
    with torch.no_grad():
        expected = model(images)
        assert torch.equal(plain.eval()(images), expected)
        for loaded in (torch.jit.load(script), torch.export.load(program).module()):
            assert (loaded(images) - expected).abs().max() <= 1e-5


def test_export_torchvision_state_dict(tmp_path: Path, capsys):
    """A DDP-prefixed torchvision state_dict; arch and size given on the line."""
    torch.manual_seed(0)
    original = torchvision.models.resnet18(num_classes=10).eval()
    for name, buffer in original.named_buffers():
        if name.endswith("running_mean"):
            buffer.normal_()  # statistics that matter in eval mode
    source, out = tmp_path / "ddp.pth", tmp_path / "r18.pth"
    torch.save({f"module.{k}": v for k, v in original.state_dict().items()}, source)
    args = ["--weights", str(source), "--out", str(out), "MODEL.ARCH", "resnet18"]
    assert export_tool.main([*args, "TRAIN.IM_SIZE", "32", "TEST.IM_SIZE", "32"]) == 0
    assert f"wrote {out} (state_dict)" in capsys.readouterr().out

    model = torchvision.models.resnet18(num_classes=10)
    model.load_state_dict(torch.load(out, weights_only=True))
    images = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(model.eval()(images), original(images))


def test_export_fails_when_outputs_differ(trained: Path, tmp_path, capsys, monkeypatch):
    def drifting_torchscript(model, path, example):
        return lambda images: model(images) + 1e-4

    monkeypatch.setattr(exporting, "write_torchscript", drifting_torchscript)
    weights = str(trained / "best.pth")
    args = ["--weights", weights, "--out", str(tmp_path / "w.pth")]
    assert export_tool.main([*args, "--torchscript", str(tmp_path / "w.ts")]) == 1
    line = error_line(capsys)
    assert "TorchScript" in line and "differ" in line and "1e-05" in line


def test_export_asks_for_an_output(trained: Path, capsys):
    with pytest.raises(SystemExit) as stopped:
        export_tool.main(["--weights", str(trained / "best.pth")])
    assert stopped.value.code == 2
    assert "give at least one output" in capsys.readouterr().err


def test_export_rejects_bad_input(trained: Path, tmp_path: Path, capsys):
    out = tmp_path / "w.pth"
    missing = ["--weights", str(tmp_path / "nope.pth"), "--out", str(out)]
    assert export_tool.main(missing) == 2
    assert "no such file" in error_line(capsys)
    other_arch = ["--weights", str(trained / "best.pth"), "--out", str(out)]
    assert export_tool.main([*other_arch, "MODEL.ARCH", "resnet20"]) == 2
    assert "another architecture" in error_line(capsys)
    assert not out.exists()


# --------------------------------------------------------------------------- #
# predict.py
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def digit_files(trained: Path, tmp_path_factory) -> dict[str, tuple[int, torch.Tensor]]:
    """PNG files of validation digits 0-5 (odd ones in a subfolder), in a folder.

    Each is the first validation image of its digit that the trained model,
    evaluated the way the trainer does, classifies correctly.  Returns path ->
    (label, probabilities from that evaluation).
    """
    folder = tmp_path_factory.mktemp("digits")
    (folder / "odd").mkdir()
    (folder / "README.txt").write_text("not an image\n")
    model, cfg = reference(trained / "best.pth")
    dataset = build_dataset(data_spec(cfg), train=False)
    normalize = build_normalizer(data_spec(cfg), torch.device("cpu"))
    images, labels = load_mnist5k(train=False)
    files = {}
    for digit in DIGITS:
        for index in (labels == digit).nonzero().flatten().tolist():
            with torch.no_grad():
                batch = normalize(dataset[index][0][None])
                probabilities = model(batch).softmax(dim=1)[0]
            if probabilities.argmax() == digit:
                break
        path = folder / ("odd" if digit % 2 else "") / f"digit_{digit}.png"
        Image.fromarray(images[index, 0].numpy(), mode="L").save(path)
        files[str(path)] = (digit, probabilities)
    return files


@pytest.mark.slow
def test_predict_prints_the_right_labels(trained: Path, digit_files: dict):
    folder = os.path.commonpath(list(digit_files))
    weights = str(trained / "best.pth")
    result = tool("predict.py", "--weights", weights, "--topk", "3", folder)
    assert_ok(result)
    lines = result.stdout.splitlines()
    assert [line.split("  ")[0] for line in lines] == sorted(digit_files)
    for line in lines:
        path, *top = line.split("  ")
        label, probabilities = digit_files[path]
        printed = [re.fullmatch(r"(\d) \((\d\.\d\d)\)", t).groups() for t in top]
        assert len(printed) == 3 and printed[0][0] == str(label)
        for name, probability in printed:
            assert abs(float(probability) - probabilities[int(name)]) <= 0.0051


def test_predict_json_matches_evaluation(trained: Path, digit_files: dict, capsys):
    paths = sorted(digit_files)[:2]
    weights = str(trained / "best.pth")
    args = ["--weights", weights, "--json", "--topk", "10", "--batch-size", "1"]
    assert predict.main([*args, "--device", "cpu", *paths]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["path"] for r in records] == paths
    for record in records:
        label, probabilities = digit_files[record["path"]]
        assert record["top"][0]["class"] == str(label)
        for entry in record["top"]:
            expected = probabilities[int(entry["class"])]
            assert abs(entry["prob"] - expected) <= 1e-5


def test_predict_errors(trained: Path, digit_files: dict, tmp_path: Path, capsys):
    weights = ["--weights", str(trained / "best.pth")]
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG not really")
    empty = tmp_path / "empty"
    empty.mkdir()
    image = min(digit_files)
    cases = [
        ([*weights, str(broken)], f"cannot read image {broken}"),
        ([*weights, str(empty)], f"no image files in {empty}"),
        (["--weights", str(tmp_path / "nope.pth"), image], "no such file"),
        ([*weights, "MODEL.NUM_CLASSES", "12", image], "NUM_CLASSES"),
        ([*weights, "MODEL.ARCH", "resnet9", image], "resnet9"),
        ([*weights, image, "MODEL.ARCH"], "MODEL.ARCH has no value"),
    ]
    for argv, words in cases:
        assert predict.main(argv) == 2, argv
        assert words in error_line(capsys)


# --------------------------------------------------------------------------- #
# ONNX: export.py --onnx, predict.py --onnx (more in test_onnx.py)
# --------------------------------------------------------------------------- #


def skip_without_onnx() -> None:
    """Skip the test where the packages of the ``onnx`` extra are missing."""
    for name in ("onnx", "onnxscript", "onnxruntime"):
        pytest.importorskip(name)


@pytest.fixture(scope="module")
def onnx_export(trained: Path, tmp_path_factory) -> tuple[Path, str]:
    """The trained model exported to ONNX by export.py, and what it printed."""
    skip_without_onnx()
    folder = tmp_path_factory.mktemp("onnx")
    path = folder / "r8.onnx"
    argv = ["--weights", str(trained / "best.pth"), "--onnx", str(path)]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert export_tool.main(argv) == 0
    assert os.listdir(folder) == ["r8.onnx"]  # no --out: the ONNX file only
    return path, printed.getvalue()


@pytest.mark.slow
def test_onnx_export_is_checked_on_validation_digits(onnx_export):
    path, printed = onnx_export
    assert len(printed.splitlines()) == 1  # ONNX's line: no --out, no state_dict
    found = re.search(
        rf"^wrote {re.escape(str(path))} \(ONNX\); max abs difference (\S+) on 64 "
        r"validation images of mnist5k in batches of 32, 31, 1; top-1 agreement "
        r"64/64$",
        printed,
        re.M,
    )
    assert found and float(found.group(1)) <= 1e-4, printed


@pytest.mark.slow
def test_predict_onnx_matches_pytorch(onnx_export, trained, digit_files, capsys):
    folder = os.path.commonpath(list(digit_files))
    args = ["--json", "--topk", "10", folder]
    assert predict.main(["--onnx", str(onnx_export[0]), *args]) == 0
    with_onnx = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    weights = str(trained / "best.pth")
    assert predict.main(["--weights", weights, "--device", "cpu", *args]) == 0
    with_torch = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["path"] for r in with_onnx] == sorted(digit_files)
    for onnx_record, torch_record in zip(with_onnx, with_torch):
        label, probabilities = digit_files[onnx_record["path"]]
        classes = [entry["class"] for entry in onnx_record["top"]]
        assert classes[0] == str(label)
        assert classes == [entry["class"] for entry in torch_record["top"]]
        for entry in onnx_record["top"]:
            assert abs(entry["prob"] - probabilities[int(entry["class"])]) <= 1e-4


@pytest.mark.slow
def test_onnx_export_fails_above_the_tolerance(trained: Path, tmp_path, capsys):
    skip_without_onnx()
    weights = str(trained / "best.pth")
    args = ["--weights", weights, "--out", str(tmp_path / "w.pth")]
    # float32 kernels of ONNX Runtime and PyTorch differ by some 1e-6 here
    path = tmp_path / "w.onnx"
    assert export_tool.main([*args, "--onnx", str(path), "--atol", "1e-9"]) == 1
    line = error_line(capsys)
    assert f"ONNX {path}: ONNX Runtime's outputs differ from PyTorch's" in line
    assert "(allowed 1e-09) on 64 validation images of mnist5k" in line
    assert re.search(r"by up to [\d.]+e-0[5-7] .* top-1 agreement 64/64$", line)
