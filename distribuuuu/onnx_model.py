"""ONNX files: export with torch's exporter, check and run with ONNX Runtime.

An exported file holds the model (input ``images``, N x 3 x S x S float32
normalised as in evaluation; output ``logits``, N x classes; N dynamic) and,
in its ``metadata_props`` under ``distribuuuu.*``, what prediction needs: the
architecture, the class names and the evaluation input pipeline (data set,
resize, crop, interpolation, decoder, mean and std).  :class:`OnnxMetadata`
owns those keys.  A file given to predict is untrusted: every value is
checked (type, range, size), nothing in it is evaluated, tensors stored
outside the file are refused wherever they sit, and the graph's size and
nesting are bounded before a parser builds it.

The optional packages (onnx, onnxscript, onnxruntime: ``pip install
'distribuuuu[onnx]'``) are imported only when used.
"""

from __future__ import annotations

import functools
import importlib
import json
import math
import os
import re
import stat
import warnings
from dataclasses import dataclass

import torch
from torch import nn
from yacs.config import CfgNode

from distribuuuu import checkpoint as cp
from distribuuuu.config import CHOICES, DATA_NAMES, get_cfg, resolve_data_name
from distribuuuu.data import build_normalizer, build_test_transform, eval_sizes
from distribuuuu.data.transforms import INTERPOLATIONS, ToNormalizedFloat

INPUT_NAME, OUTPUT_NAME = "images", "logits"
# Largest accepted difference between ONNX Runtime's logits and PyTorch's.
ATOL = 1e-4
INSTALL_HINT = "pip install 'distribuuuu[onnx]'"
_PREFIX = "distribuuuu."
# Bounds on what a file's metadata may claim (it is untrusted).
_MAX_VALUE_CHARS = 16 << 20
_MAX_CLASSES, _MAX_NAME_CHARS = 100_000, 1_000
_MAX_SIZE = 8192
# The resolved data set names (never "auto") and the decoders of the config.
_DATA_NAMES = tuple(name for name in DATA_NAMES if name != "auto")
_DECODERS = CHOICES["DATA.DECODER"]
# protobuf cannot hold a larger model in one file.
_MAX_FILE_BYTES = 2**31
_UNSUPPORTED = re.compile(r"No ONNX function found for <OpOverload\(op='([^']+)'")


class OnnxError(ValueError):
    """An ONNX export or file that cannot be used; one line saying why."""


def require(*names: str) -> list:
    """Import the packages ``names``; an OnnxError names the extra to install."""
    modules = []
    for name in names:
        try:
            modules.append(importlib.import_module(name))
        except ImportError:
            raise OnnxError(f"ONNX needs the {name} package: {INSTALL_HINT}") from None
    return modules


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

    @classmethod
    def from_cfg(cls, cfg: CfgNode, classes: list[str]) -> OnnxMetadata:
        """The metadata of a model trained with ``cfg``, classes ``classes``."""
        normalizer = build_normalizer(cfg, torch.device("cpu"))
        resize, crop = eval_sizes(cfg)
        return cls(
            cfg.MODEL.ARCH,
            tuple(classes),
            resolve_data_name(cfg),
            crop,
            resize,
            cfg.TEST.INTERPOLATION,
            cfg.DATA.DECODER,
            normalizer.mean,
            normalizer.std,
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
        }
        return {_PREFIX + key: value for key, value in values.items()}

    @classmethod
    def from_props(cls, props: dict[str, str], path: str) -> OnnxMetadata:
        """Read and check the entries of an untrusted file; an OnnxError names
        the first bad one."""
        reader = _PropsReader(props, path)
        return cls(
            reader.name("arch"),
            tuple(reader.classes()),
            reader.choice("data_name", _DATA_NAMES),
            reader.size("input_size"),
            reader.size("resize"),
            reader.choice("interpolation", tuple(INTERPOLATIONS)),
            reader.choice("decoder", _DECODERS),
            reader.triple("mean", low=-1e3),
            reader.triple("std", low=1e-6),
        )

    def eval_cfg(self) -> CfgNode:
        """A cfg whose evaluation transform and image reader are this file's."""
        cfg = get_cfg()
        cfg.MODEL.ARCH, cfg.MODEL.NUM_CLASSES = self.arch, len(self.classes)
        # Files are read on the CPU here: gpu's pixels there are tensor's.
        decoder = "tensor" if self.decoder == "gpu" else self.decoder
        cfg.DATA.NAME, cfg.DATA.DECODER = self.data_name, decoder
        cfg.TRAIN.IM_SIZE = cfg.TEST.CROP_SIZE = self.input_size
        cfg.TEST.IM_SIZE, cfg.TEST.CROP_PCT = self.resize, 0.0
        cfg.TEST.INTERPOLATION = self.interpolation
        cfg.freeze()
        return cfg

    def eval_transform(self):
        """The evaluation transform of one image, normalised with mean and std."""
        normalize = ToNormalizedFloat(self.mean, self.std)
        return build_test_transform(self.eval_cfg(), normalize)


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
        return tuple(float(v) for v in value)

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
    program.model.metadata_props.update(metadata.to_props())
    return program.model_proto


def write_model(proto, path: str) -> None:
    """Write a model proto to ``path`` atomically, as one self-contained file."""
    data = proto.SerializeToString()
    cp.atomic_write(path, lambda f: f.write(data))


# --------------------------------------------------------------------------- #
# Reading and running a file
# --------------------------------------------------------------------------- #

# Bounds on an untrusted file, checked before a parser builds it.  Exported
# classifiers are far inside them (resnet50: 122 nodes in 7,312 protobuf
# fields; vit_b_16: 476 nodes in 19,954 fields), with no subgraphs and no
# functions.  Without them, 1 KB of functions that call one another is
# inlined into millions of nodes, 10 MB of empty nodes take the parser to
# 770 MB, and 200 MB of nested subgraphs took ONNX Runtime to 22 GB.
_MAX_WIRE_VALUES = 1_000_000  # fields; a packed varint field: one per byte
_MAX_WIRE_NESTING = 100  # messages in messages: protobuf's own limit
_MAX_NODES = 100_000  # with model-local functions inlined where called
_MAX_SUBGRAPHS = 1_000  # the bodies of If, Loop and Scan nodes
_MAX_DEPTH = 16  # subgraphs and function calls nested in one another


class _MalformedError(ValueError):
    """Bytes that are not a message of onnx's schema."""


@functools.cache
def _wire_schema(descriptor) -> dict[int, tuple[int, object, bool]]:
    """Field number -> (its wire type, its message type or None, repeated)."""
    from google.protobuf.descriptor import FieldDescriptor as Field

    fixed64 = (Field.TYPE_DOUBLE, Field.TYPE_FIXED64, Field.TYPE_SFIXED64)
    fixed32 = (Field.TYPE_FLOAT, Field.TYPE_FIXED32, Field.TYPE_SFIXED32)
    length = (Field.TYPE_STRING, Field.TYPE_BYTES, Field.TYPE_MESSAGE)
    schema = {}
    for field in descriptor.fields:
        wire = 1 if field.type in fixed64 else 5 if field.type in fixed32 else 0
        wire = 2 if field.type in length else wire
        schema[field.number] = (wire, field.message_type, _is_repeated(field))
    return schema


def _is_repeated(field) -> bool:
    """Whether a protobuf field descriptor is repeated (protobuf 4 to 7)."""
    if hasattr(field, "is_repeated"):  # protobuf 7 drops ``label``
        return field.is_repeated
    return field.label == field.LABEL_REPEATED


def _read_varint(data: bytes, at: int, end: int) -> tuple[int, int]:
    """The varint at ``data[at]`` and the offset after it."""
    if at < end and data[at] < 0x80:  # most are one byte
        return data[at], at + 1
    value = 0
    for shift in range(0, 70, 7):
        if at >= end:
            raise _MalformedError("it is cut short")
        value |= (data[at] & 0x7F) << shift
        at += 1
        if data[at - 1] < 0x80:
            return value, at
    raise _MalformedError("a varint runs past 10 bytes")


def _scan_wire(data: bytes, descriptor) -> None:
    """Walk serialised bytes against onnx's schema before any parser builds
    them.  An unknown field or a wrong wire type is a _MalformedError; more
    fields than a parser should build, or deeper nesting, a ValueError."""
    frames = [(len(data), _wire_schema(descriptor), descriptor.name)]
    at = values = 0
    while frames:
        end, schema, name = frames[-1]
        if at == end:  # the message ends; its parent goes on
            frames.pop()
            continue
        key, at = _read_varint(data, at, end)
        if key >> 3 not in schema:
            raise _MalformedError(f"{name} has no field {key >> 3}")
        (expected, inner, repeated), wire = schema[key >> 3], key & 7
        values += 1
        if values > _MAX_WIRE_VALUES:
            raise ValueError(
                f"it holds over {_MAX_WIRE_VALUES:,} protobuf fields (an "
                "exported classifier holds far fewer)"
            )
        if wire == 2:
            size, at = _read_varint(data, at, end)
            if inner is not None and at + size <= end:
                if len(frames) > _MAX_WIRE_NESTING:
                    raise ValueError(f"its messages nest over {_MAX_WIRE_NESTING} deep")
                frames.append((at + size, _wire_schema(inner), inner.name))
                continue
            if expected != 2 and not repeated:
                raise _MalformedError("a single number is stored as bytes")
            values += size if expected == 0 else 0  # packed: a varint per byte
            at += size
        elif wire != expected:
            raise _MalformedError(f"a field has wire type {wire}, not {expected}")
        elif wire == 0:
            at = _read_varint(data, at, end)[1]
        else:
            at += 8 if wire == 1 else 4
        if at > end:
            raise _MalformedError("it is cut short")


def _reads_other_files(message) -> bool:
    """Whether a tensor anywhere within ``message`` (initializers, sparse
    tensors, attributes, subgraphs, functions, training graphs) keeps its
    data outside the file."""
    stack = [message]
    while stack:
        current = stack.pop()
        if current.DESCRIPTOR.full_name == "onnx.TensorProto":
            if current.data_location != current.DEFAULT or current.external_data:
                return True
            continue  # holds no tensor, and listing it would copy its data
        for field, value in current.ListFields():
            if field.message_type is not None:
                stack.extend(value if _is_repeated(field) else [value])
    return False


def _shown(key: tuple[str, str]) -> str:
    """A function's ``domain.name`` for an error line, quoted and cut short."""
    return repr(".".join(key)[:80])


def _subgraphs(attributes):
    """The graphs that ``attributes`` hold."""
    for attribute in attributes:
        if attribute.HasField("g"):
            yield attribute.g
        yield from attribute.graphs


class _GraphSize:
    """Nodes, subgraphs and nesting of a model as ONNX Runtime builds it, with
    model-local functions inlined where they are called.  A ValueError says
    which bound it passes; sizes are (nodes, subgraphs, levels below)."""

    def __init__(self, proto):
        self.functions, self.known = {}, {}
        for function in proto.functions:
            key = (function.domain, function.name)
            if key in self.functions:
                raise ValueError(f"it defines the function {_shown(key)} twice")
            self.functions[key] = function
        size = self.of_nodes(proto.graph.node, level=0)
        for function in self.functions.values():  # called or not: each is read
            self.add(size, self.of_function(function, level=1), graphs=0)

    def of_nodes(self, nodes, level: int, defaults=()) -> list[int]:
        """The size of ``nodes`` at nesting ``level`` (``defaults``: the
        default attribute values of the function they make)."""
        if level > _MAX_DEPTH:
            raise ValueError(f"its subgraphs and functions nest over {_MAX_DEPTH} deep")
        size = [0, 0, 0]
        for graph in _subgraphs(defaults):
            self.add(size, self.of_nodes(graph.node, level + 1), graphs=1)
        for node in nodes:
            size[0] += 1
            for graph in _subgraphs(node.attribute):
                self.add(size, self.of_nodes(graph.node, level + 1), graphs=1)
            function = self.functions.get((node.domain, node.op_type))
            if function is not None:
                self.add(size, self.of_function(function, level + 1), graphs=0)
            self.check(size)
        return size

    def of_function(self, function, level: int) -> list[int]:
        """The size of a call of ``function`` at nesting ``level``."""
        key = (function.domain, function.name)
        if key not in self.known:
            self.known[key] = None  # a call back to it while measured: a loop
            body = self.of_nodes(function.node, level, function.attribute_proto)
            self.known[key] = body
        if self.known[key] is None:
            raise ValueError(f"its function {_shown(key)} calls itself")
        if level + self.known[key][2] > _MAX_DEPTH:
            raise ValueError(f"its subgraphs and functions nest over {_MAX_DEPTH} deep")
        return self.known[key]

    @staticmethod
    def add(size: list[int], part: list[int], graphs: int) -> None:
        """Add ``part``, nested one level below, to ``size``; check the bounds."""
        size[0], size[1] = size[0] + part[0], size[1] + part[1] + graphs
        size[2] = max(size[2], part[2] + 1)
        _GraphSize.check(size)

    @staticmethod
    def check(size: list[int]) -> None:
        """A ValueError if ``size`` passes the bound on nodes or subgraphs."""
        if size[0] > _MAX_NODES:
            raise ValueError(
                f"its graph has over {_MAX_NODES:,} nodes (functions inlined)"
            )
        if size[1] > _MAX_SUBGRAPHS:
            raise ValueError(f"its graph has over {_MAX_SUBGRAPHS:,} subgraphs")


def _read_file(path: str) -> bytes:
    """The bytes of the regular file ``path``; never blocks on a FIFO."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise OnnxError(f"{path}: no such file") from None
    except OSError as error:
        raise OnnxError(f"{path}: cannot be read ({error.strerror})") from None
    with os.fdopen(descriptor, "rb") as f:
        mode, size = os.fstat(f.fileno()).st_mode, os.fstat(f.fileno()).st_size
        if stat.S_ISDIR(mode):
            raise OnnxError(f"{path}: is a directory")
        if not stat.S_ISREG(mode):
            raise OnnxError(f"{path}: not a regular file")
        if size >= _MAX_FILE_BYTES:
            raise OnnxError(f"{path}: larger than an ONNX file can be (2 GiB)")
        return f.read(_MAX_FILE_BYTES)


def check_model_bytes(data: bytes, path: str) -> dict[str, str]:
    """The ``metadata_props`` of an untrusted serialised model, once it is
    known to be safe to hand ONNX Runtime: bounded in size and nesting, and
    every tensor inside the file.  Anything else is an OnnxError."""
    (onnx,) = require("onnx")
    try:
        _scan_wire(data, onnx.ModelProto.DESCRIPTOR)
    except _MalformedError as why:
        raise OnnxError(f"{path}: not an ONNX model ({why})") from None
    except ValueError as why:
        raise OnnxError(f"{path}: refused: {why}") from None
    try:
        proto = onnx.load_model_from_string(data)
    except Exception:  # protobuf raises several types
        raise OnnxError(f"{path}: not an ONNX model") from None
    if not proto.graph.node:
        raise OnnxError(f"{path}: not an ONNX model (it has no graph)")
    if _reads_other_files(proto):
        raise OnnxError(f"{path}: refused: it reads tensors from other files")
    try:
        _GraphSize(proto)
    except ValueError as why:
        raise OnnxError(f"{path}: refused: {why}") from None
    return {entry.key: entry.value for entry in proto.metadata_props}


def load_session(path: str):
    """An ONNX Runtime CPU session of the file ``path`` and its metadata.

    The file must be one of ours: a model ONNX Runtime accepts, every tensor
    inside the file, a bounded graph (:func:`check_model_bytes`), valid
    ``distribuuuu.*`` metadata, and the input and output shapes that metadata
    implies.  Anything else is an OnnxError.
    """
    _, ort = require("onnx", "onnxruntime")
    data = _read_file(path)
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
