"""Checks of an untrusted ONNX file: whether it may be given to ONNX Runtime.

A file given to ``predict --onnx`` may come from anyone, so nothing in it is
trusted until these checks pass, and each bound exists for that reason:

- The file is read without blocking (a FIFO is refused, never waited on), as a
  regular file below protobuf's 2 GiB limit.
- Its bytes are walked against onnx's schema (:func:`_scan_wire`) before any
  parser builds them: a field the installed onnx does not know could hide a
  tensor from the checks below that ONNX Runtime's own schema would read, and
  the number of fields and the nesting of messages are bounded, since the
  parser's memory grows with them (10 MB of empty nodes: 770 MB).
- A tensor that keeps its data outside the file (external data) is refused
  wherever it sits (initializers, sparse tensors, attributes, subgraphs,
  functions and their default attributes, training graphs): ONNX Runtime
  would read any other file it names, a secret included, into the logits.
- The graph is measured as ONNX Runtime builds it (:class:`_GraphSize`), with
  model-local functions inlined where they are called, and its nodes,
  subgraphs and nesting are bounded before onnx or ONNX Runtime build it: a
  few KB of functions that call one another inline into millions of nodes,
  and nested subgraphs took ONNX Runtime to 22 GB.

:func:`check_model_bytes` runs them all; :mod:`distribuuuu.inference.onnx` loads a
file only once it has passed.  :class:`OnnxError` and :func:`require` live
here, below the checks that raise and import with them, and onnx_model uses
them as its own.  The optional onnx package is imported only when used.
"""

from __future__ import annotations

import functools
import importlib
import os
import stat
from typing import Any

from distribuuuu.errors import OnnxError

INSTALL_HINT = "pip install 'distribuuuu[onnx]'"
# protobuf cannot hold a larger model in one file.
_MAX_FILE_BYTES = 2**31

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


def require(*names: str) -> list:
    """Import the packages ``names``; an OnnxError names the extra to install."""
    modules = []
    for name in names:
        try:
            modules.append(importlib.import_module(name))
        except ImportError:
            raise OnnxError(f"ONNX needs the {name} package: {INSTALL_HINT}") from None
    return modules


class _MalformedError(ValueError):
    """Bytes that are not a message of onnx's schema."""


@functools.cache
def _wire_schema(descriptor) -> dict[int, tuple[int, Any, bool]]:
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


def read_file(path: str) -> bytes:
    """The bytes of the regular file ``path``; never blocks on a FIFO."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise OnnxError(f"{path}: no such file") from None
    except OSError as error:
        raise OnnxError(f"{path}: cannot be read ({error.strerror})") from None
    with os.fdopen(descriptor, "rb") as f:
        status = os.fstat(f.fileno())
        mode, size = status.st_mode, status.st_size
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
