"""ONNX files: export with torch's exporter, check and run with ONNX Runtime.

An exported file holds the model (input ``images``, N x 3 x S x S float32
normalised as in evaluation; output ``logits``, N x classes; N dynamic) and,
in its ``metadata_props`` under ``distribuuuu.*``, what prediction needs: the
architecture, the class names and the evaluation input pipeline (data set,
resize, crop, interpolation, decoder, mean and std).  :class:`OnnxMetadata`
owns those keys.  A file given to predict is untrusted: every metadata value
is checked (type, range, size) and nothing in it is evaluated; the file itself
passes :func:`distribuuuu.inference.onnx_checks.check_model_bytes` (tensors stored
outside it refused, its size and nesting bounded) before ONNX Runtime sees it.

The optional packages (onnx, onnxscript, onnxruntime: ``pip install
'distribuuuu[onnx]'``) are imported only when used.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from distribuuuu import checkpoint as cp
from distribuuuu.checkpoint.format import SAVED_LOSSES
from distribuuuu.config import CHOICES, DATA_NAMES
from distribuuuu.data import build_normalizer, build_test_transform, eval_sizes
from distribuuuu.data.spec import DataSpec, TransformSpec
from distribuuuu.data.transforms import INTERPOLATIONS, ToNormalizedFloat
from distribuuuu.errors import OnnxError
from distribuuuu.inference.onnx_checks import check_model_bytes, read_file, require

if TYPE_CHECKING:  # imported for the annotations only
    from distribuuuu.inference.read import InferenceSpec

INPUT_NAME, OUTPUT_NAME = "images", "logits"
# Largest accepted difference between ONNX Runtime's logits and PyTorch's.
ATOL = 1e-4
_PREFIX = "distribuuuu."
# Bounds on what a file's metadata may claim (it is untrusted).
_MAX_VALUE_CHARS = 16 << 20
_MAX_CLASSES, _MAX_NAME_CHARS = 100_000, 1_000
_MAX_SIZE = 8192
# The resolved data set names (never "auto") and the decoders of the config.
_DATA_NAMES = tuple(name for name in DATA_NAMES if name != "auto")
_DECODERS = CHOICES["DATA.DECODER"]
_UNSUPPORTED = re.compile(r"No ONNX function found for <OpOverload\(op='([^']+)'")


@dataclass(frozen=True)
class OnnxMetadata:
    """What predicting with an ONNX file needs besides the graph."""

    arch: str
    classes: tuple[str, ...]
    data_name: str  # DATA.NAME resolved: the pipeline of its images
    input_size: int  # the centre crop: the model's input is size x size
    resize: int  # the shorter side is resized to this before the crop
    interpolation: str
    decoder: str  # DATA.DECODER: how image files are read
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    loss: str = "ce"  # MODEL.LOSS: softmax logits (ce) or sigmoid ones
    threshold: float = 0.5  # TEST.THRESHOLD: sigmoid labels predicted at or above

    @classmethod
    def from_spec(cls, spec: InferenceSpec, classes: list[str]) -> OnnxMetadata:
        """The metadata of a model of ``spec`` with the classes ``classes``."""
        data = spec.data
        normalizer = build_normalizer(data, torch.device("cpu"))
        resize, crop = eval_sizes(data.transform)
        return cls(
            arch=spec.arch,
            classes=tuple(classes),
            data_name=data.name,
            input_size=crop,
            resize=resize,
            interpolation=data.transform.test_interpolation,
            decoder=data.decoder,
            mean=normalizer.mean,
            std=normalizer.std,
            loss=spec.loss,
            threshold=spec.threshold,
        )

    def to_props(self) -> dict[str, str]:
        """The ``metadata_props`` entries: plain strings, lists as JSON."""
        values = {
            "arch": self.arch,
            "classes": json.dumps(list(self.classes)),
            "data_name": self.data_name,
            "input_size": str(self.input_size),
            "resize": str(self.resize),
            "interpolation": self.interpolation,
            "decoder": self.decoder,
            "mean": json.dumps(list(self.mean)),
            "std": json.dumps(list(self.std)),
            "loss": self.loss,
            "threshold": repr(self.threshold),
        }
        return {_PREFIX + key: value for key, value in values.items()}

    @classmethod
    def from_props(cls, props: dict[str, str], path: str) -> OnnxMetadata:
        """Read and check the entries of an untrusted file; an OnnxError names
        the first bad one."""
        reader = _PropsReader(props, path)
        # Files exported before the loss was recorded hold softmax models.
        loss = reader.choice("loss", SAVED_LOSSES) if reader.has("loss") else "ce"
        has_threshold = reader.has("threshold")
        return cls(
            arch=reader.name("arch"),
            classes=tuple(reader.classes()),
            data_name=reader.choice("data_name", _DATA_NAMES),
            input_size=reader.size("input_size"),
            resize=reader.size("resize"),
            interpolation=reader.choice("interpolation", tuple(INTERPOLATIONS)),
            decoder=reader.choice("decoder", _DECODERS),
            mean=reader.triple("mean", low=-1e3),
            std=reader.triple("std", low=1e-6),
            loss=loss,
            threshold=reader.probability("threshold") if has_threshold else 0.5,
        )

    def data_spec(self) -> DataSpec:
        """The evaluation side of this file's data set: how predicting reads
        and transforms an image (its files, nothing else of the data set)."""
        # Files are read on the CPU here: gpu's pixels there are tensor's.
        decoder = "tensor" if self.decoder == "gpu" else self.decoder
        sizes = TransformSpec(
            im_size=self.input_size,
            test_im_size=self.resize,
            test_crop_size=self.input_size,
            test_crop_pct=0.0,
            test_interpolation=self.interpolation,
        )
        return DataSpec(
            name=self.data_name,
            transform=sizes,
            num_classes=len(self.classes),
            decoder=decoder,
        )

    def eval_transform(self):
        """The evaluation transform of one image, normalised with mean and std."""
        normalize = ToNormalizedFloat(self.mean, self.std)
        return build_test_transform(self.data_spec(), normalize)


def _is_name(value: object) -> bool:
    """A string a terminal shows as it is: printable, at most a line long."""
    return (
        isinstance(value, str) and len(value) <= _MAX_NAME_CHARS and value.isprintable()
    )


class _PropsReader:
    """Typed, bounded reads of ``distribuuuu.*`` metadata entries."""

    def __init__(self, props: dict[str, str], path: str):
        self.props, self.path = props, path

    def fail(self, key: str, why: str) -> OnnxError:
        return OnnxError(f"{self.path}: metadata {_PREFIX}{key} {why}")

    def text(self, key: str) -> str:
        value = self.props.get(_PREFIX + key)
        if not isinstance(value, str):
            raise OnnxError(
                f"{self.path}: no {_PREFIX}{key} in its metadata (not a file "
                "that tools/export.py --onnx wrote)"
            )
        if len(value) > _MAX_VALUE_CHARS:
            raise self.fail(key, f"is longer than {_MAX_VALUE_CHARS} characters")
        return value

    def json(self, key: str):
        try:
            return json.loads(self.text(key))
        except (ValueError, RecursionError):
            raise self.fail(key, "is not valid JSON") from None

    def name(self, key: str) -> str:
        value = self.text(key)
        if not (value and _is_name(value)):
            raise self.fail(key, f"{value[:40]!r} is not a short printable name")
        return value

    def has(self, key: str) -> bool:
        return _PREFIX + key in self.props

    def probability(self, key: str) -> float:
        value = self.text(key)
        try:
            number = float(value[:40])
        except ValueError:
            number = math.nan
        if not 0 < number < 1:
            raise self.fail(key, f"{value[:40]!r} is not a number in (0, 1)")
        return number

    def choice(self, key: str, choices: tuple[str, ...]) -> str:
        value = self.text(key)
        if value not in choices:
            raise self.fail(key, f"{value[:40]!r} is not one of {', '.join(choices)}")
        return value

    def size(self, key: str) -> int:
        value = self.text(key)
        if not (value.isascii() and value.isdigit() and 0 < int(value) <= _MAX_SIZE):
            raise self.fail(key, f"{value[:40]!r} is not a size of 1-{_MAX_SIZE} px")
        return int(value)

    def triple(self, key: str, low: float) -> tuple[float, float, float]:
        value = self.json(key)
        if not (
            isinstance(value, list)
            and len(value) == 3
            and all(type(v) in (int, float) and low <= v <= 1e3 for v in value)
        ):
            raise self.fail(key, f"is not 3 numbers in [{low:g}, 1000]")
        return float(value[0]), float(value[1]), float(value[2])

    def classes(self) -> list[str]:
        value = self.json("classes")
        if not (
            isinstance(value, list)
            and 0 < len(value) <= _MAX_CLASSES
            and all(_is_name(v) for v in value)
        ):
            raise self.fail(
                "classes",
                f"is not a list of 1-{_MAX_CLASSES} printable names of at most "
                f"{_MAX_NAME_CHARS} characters",
            )
        return value


# --------------------------------------------------------------------------- #
# Export
# --------------------------------------------------------------------------- #


def unsupported_operator(error: BaseException) -> str | None:
    """The operator that torch's ONNX exporter could not lower, if that failed."""
    found = _UNSUPPORTED.search(str(error))
    return found.group(1) if found else None


def export_program(model: nn.Module, example: torch.Tensor, metadata: OnnxMetadata):
    """Export ``model`` (dynamic batch size) to an in-memory ONNX model proto.

    An operator the exporter cannot lower raises an OnnxError naming it.
    """
    require("onnx", "onnxscript", "onnxruntime")  # all before a file is written
    batch = torch.export.Dim("batch", min=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the exporter's notes on internals
            program = torch.onnx.export(
                model,
                (example,),
                dynamo=True,
                dynamic_shapes=({0: batch},),
                input_names=[INPUT_NAME],
                output_names=[OUTPUT_NAME],
                verbose=False,
            )
    except Exception as error:  # the exporter raises many types
        operator = unsupported_operator(error)
        if operator is None:
            raise
        raise OnnxError(
            f"{metadata.arch} cannot be exported to ONNX: torch's exporter has "
            f"no ONNX function for the operator {operator}"
        ) from None
    # dynamo=True: a program, always (None is the legacy exporter's).
    assert program is not None
    program.model.metadata_props.update(metadata.to_props())
    return program.model_proto


def write_model(proto, path: str) -> None:
    """Write a model proto to ``path`` atomically, as one self-contained file."""
    data = proto.SerializeToString()
    cp.atomic_write(path, lambda f: f.write(data))


# --------------------------------------------------------------------------- #
# Reading and running a file
# --------------------------------------------------------------------------- #


def load_session(path: str):
    """An ONNX Runtime CPU session of the file ``path`` and its metadata.

    The file must be one of ours: a model ONNX Runtime accepts, every tensor
    inside the file, a bounded graph (:func:`check_model_bytes`), valid
    ``distribuuuu.*`` metadata, and the input and output shapes that metadata
    implies.  Anything else is an OnnxError.
    """
    _, ort = require("onnx", "onnxruntime")
    data = read_file(path)
    metadata = OnnxMetadata.from_props(check_model_bytes(data, path), path)
    options = ort.SessionOptions()
    # Parsed as the protobuf just checked, never as an ORT-format flatbuffer
    # (which bytes 4-8 reading "ORTM" would otherwise select).
    options.add_session_config_entry("session.load_model_format", "ONNX")
    try:
        session = ort.InferenceSession(
            data, options, providers=["CPUExecutionProvider"]
        )
    except Exception as error:  # ONNX Runtime raises its own types
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise OnnxError(f"{path}: ONNX Runtime cannot load it ({first})") from None
    _check_signature(session, metadata, path)
    return session, metadata


def _check_signature(session, metadata: OnnxMetadata, path: str) -> None:
    """The session takes N x 3 x S x S ``images`` and gives N x classes logits."""
    inputs, outputs = session.get_inputs(), session.get_outputs()
    size, classes = metadata.input_size, len(metadata.classes)
    if not (
        len(inputs) == 1
        and inputs[0].name == INPUT_NAME
        and inputs[0].type == "tensor(float)"
        and inputs[0].shape[1:] == [3, size, size]
        and len(outputs) == 1
        and outputs[0].name == OUTPUT_NAME
        and outputs[0].type == "tensor(float)"
        and outputs[0].shape[1:] == [classes]
    ):
        raise OnnxError(
            f"{path}: its graph does not take {INPUT_NAME} of N x 3 x {size} x "
            f"{size} and give N x {classes} logits as its metadata says"
        )


def run_session(session, images: torch.Tensor) -> torch.Tensor:
    """The logits ONNX Runtime computes for a batch of normalised images."""
    array = images.detach().to("cpu", torch.float32).contiguous().numpy()
    (logits,) = session.run([OUTPUT_NAME], {INPUT_NAME: array})
    return torch.from_numpy(logits)


def compare(model: nn.Module, session, batches: list[torch.Tensor]):
    """Largest absolute logit difference and top-1 agreements over ``batches``."""
    difference, agree = 0.0, 0
    for images in batches:
        with torch.no_grad():
            expected = model(images)
        logits = run_session(session, images)
        gap = (logits - expected).abs().max().item()
        difference = gap if math.isnan(gap) else max(difference, gap)
        agree += (logits.argmax(1) == expected.argmax(1)).sum().item()
    return difference, agree
