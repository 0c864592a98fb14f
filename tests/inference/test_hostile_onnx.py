"""Crafted ONNX files that predict --onnx refuses before a parser or ONNX
Runtime builds them: tensors read from other files wherever they hide, and
graphs whose size or nesting would take unbounded time or memory.

Each file is a few KB made with onnx.helper; ONNX Runtime is replaced by a
stand-in that fails the test if the file ever reaches it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import error_line
from PIL import Image

from distribuuuu.inference import onnx_checks
from distribuuuu.tools import predict

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
TensorProto, helper = onnx.TensorProto, onnx.helper

OPSETS = [helper.make_opsetid("", 17), helper.make_opsetid("local", 1)]
SECRET = b"AWS_SECRET_ACCESS_KEY=not-for-the-logits!"


@pytest.fixture
def refuse(tmp_path: Path, monkeypatch, capsys):
    """Write a model proto, run predict --onnx on it from ``tmp_path`` (where a
    secret file sits) and return its one error line; ONNX Runtime must never
    be given the file."""
    image = tmp_path / "a.png"
    Image.new("RGB", (7, 5), (200, 100, 0)).save(image)
    (tmp_path / "secret.bin").write_bytes(SECRET.ljust(96, b"\0"))
    monkeypatch.chdir(tmp_path)  # where ONNX Runtime resolves relative paths

    def never_loaded(*args, **kwargs):
        raise AssertionError("the file reached ONNX Runtime")

    monkeypatch.setattr(ort, "InferenceSession", never_loaded)

    def run(model, name: str = "m.onnx") -> str:
        path = tmp_path / name
        path.write_bytes(model if isinstance(model, bytes) else serialize(model))
        assert predict.main(["--onnx", str(path), str(image)]) == 2
        line = error_line(capsys)
        assert str(path) in line, line
        return line

    return run


def serialize(model) -> bytes:
    return model.SerializeToString()


def secret_tensor(name: str, dims=(12, 2)):
    """A float tensor whose data ONNX Runtime would read from ./secret.bin."""
    tensor = onnx.TensorProto(name=name, data_type=TensorProto.FLOAT, dims=dims)
    tensor.data_location = TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value="secret.bin")
    return tensor


def secret_sparse(dims=(12, 2)):
    """A sparse tensor whose 3 values come from ./secret.bin."""
    indices = helper.make_tensor("i", TensorProto.INT64, [3], [0, 1, 2])
    return helper.make_sparse_tensor(secret_tensor("v", (3,)), indices, list(dims))


def value(name: str, shape=(None, 2)):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))


def classifier(weight_nodes, functions=(), **graph_extras):
    """images N x 3 x 2 x 2 -> flattened, times ``w`` -> logits N x 2, where
    ``weight_nodes`` make ``w`` (and may call ``functions``)."""
    nodes = [
        *weight_nodes,
        helper.make_node("Flatten", ["images"], ["flat"]),
        helper.make_node("MatMul", ["flat", "w"], ["logits"]),
    ]
    inputs = [value("images", (None, 3, 2, 2))]
    graph = helper.make_graph(nodes, "g", inputs, [value("logits")], **graph_extras)
    return helper.make_model(graph, opset_imports=OPSETS, functions=list(functions))


def function(name: str, nodes, inputs=(), outputs=("w",), **extras):
    """A model-local function ``local.name``."""
    return helper.make_function(
        "local", name, list(inputs), list(outputs), nodes, OPSETS, **extras
    )


def call(name: str, inputs=(), outputs=("w",)):
    """A node that calls the model-local function ``local.name``."""
    return helper.make_node(name, list(inputs), list(outputs), domain="local")


def branching(branch_nodes, output: str = "w"):
    """An If node that makes ``output`` with ``branch_nodes`` or a constant."""
    outputs = [value(output, (12, 2))]
    branch = helper.make_graph(branch_nodes, "then", [], outputs)
    other = helper.make_graph([constant(output)], "else", [], outputs)
    condition = helper.make_tensor("c", TensorProto.BOOL, [], [True])
    return [
        helper.make_node("Constant", [], [f"{output}_cond"], value=condition),
        helper.make_node(
            "If", [f"{output}_cond"], [output], then_branch=branch, else_branch=other
        ),
    ]


def secret_constant(output: str = "w"):
    return helper.make_node("Constant", [], [output], value=secret_tensor("s"))


def function_default_secret():
    """A function whose Constant takes its value from a default attribute."""
    constant = helper.make_node("Constant", [], ["w"])
    constant.attribute.add(
        name="value", ref_attr_name="weights", type=onnx.AttributeProto.TENSOR
    )
    default = helper.make_attribute("weights", secret_tensor("d"))
    leak = function("Leak", [constant], attribute_protos=[default])
    return classifier([call("Leak")], [leak])


def training_secret():
    model = classifier([constant()])
    initialization = helper.make_graph([], "init", [], [], [secret_tensor("t")])
    model.training_info.add(initialization=initialization)
    return model


EXTERNAL = {
    "in a function": lambda: classifier(
        [call("Leak")], [function("Leak", [secret_constant()])]
    ),
    "in a function's default attribute": function_default_secret,
    "in a subgraph of a function": lambda: classifier(
        [call("Leak")], [function("Leak", branching([secret_constant()]))]
    ),
    "as a sparse constant": lambda: classifier(
        [helper.make_node("Constant", [], ["w"], sparse_value=secret_sparse())]
    ),
    "in a list of sparse tensors": lambda: classifier(
        [helper.make_node("Constant", [], ["w"], payload=[secret_sparse()])]
    ),
    "in a sparse initializer": lambda: classifier(
        [], sparse_initializer=[secret_sparse()]
    ),
    "in a training graph": training_secret,
}


@pytest.mark.parametrize("where", list(EXTERNAL))
def test_tensors_from_other_files_are_refused(refuse, where):
    """However deep the tensor sits, the secret never reaches the logits."""
    assert "refused: it reads tensors from other files" in refuse(EXTERNAL[where]())


def constant(output: str = "w"):
    """A Constant node that makes a harmless 12 x 2 ``output``."""
    weights = helper.make_tensor("k", TensorProto.FLOAT, [12, 2], [0.5] * 24)
    return helper.make_node("Constant", [], [output], value=weights)


def multiplying_functions(levels: int, calls: int):
    """Functions that each call the one before ``calls`` times in a chain: a
    call of the last is over ``calls ** (levels - 1)`` nodes once inlined."""
    functions = [
        function("F0", [helper.make_node("Identity", ["a"], ["b"])], ["a"], ["b"])
    ]
    for level in range(1, levels):
        chain = ["a", *(f"t{i}" for i in range(calls - 1)), "b"]
        nodes = [call(f"F{level - 1}", [x], [y]) for x, y in zip(chain, chain[1:])]
        functions.append(function(f"F{level}", nodes, ["a"], ["b"]))
    last = call(f"F{levels - 1}", ["images"], ["spare"])
    return classifier([last, constant()], functions)


def nested_ifs(depth: int):
    """An If in a branch of an If ... ``depth`` deep, that makes ``w``."""
    nodes = [constant()]
    for _ in range(depth):
        nodes = branching(nodes)
    return classifier(nodes)


def many_subgraphs():
    """A function holding 40 If nodes, called 30 times: 2,400 subgraphs."""
    ifs = [node for i in range(40) for node in branching([constant(f"o{i}")], f"o{i}")]
    calls = [call("Branches", [], [f"x{i}"]) for i in range(30)]
    return classifier([*calls, constant()], [function("Branches", ifs, [], ["o0"])])


def self_calling():
    """A function whose body calls the function itself."""
    loop = function("Loop", [call("Loop", ["a"], ["b"])], ["a"], ["b"])
    return classifier([call("Loop", ["images"], ["spare"]), constant()], [loop])


BOUNDS = {
    "has over 100,000 nodes (functions inlined)": lambda: multiplying_functions(6, 10),
    "subgraphs and functions nest over 16 deep": lambda: nested_ifs(17),
    "has over 1,000 subgraphs": many_subgraphs,
    "function 'local.Loop' calls itself": self_calling,
}


@pytest.mark.parametrize("words", list(BOUNDS))
def test_unbounded_graphs_are_refused(refuse, words):
    """A few KB each, which ONNX Runtime would build for minutes or for ever."""
    line = refuse(BOUNDS[words]())
    assert ": refused: " in line and words in line, line


def test_graphs_within_the_bounds_pass_the_check():
    for model in (nested_ifs(16), multiplying_functions(5, 10)):  # 21,114 nodes
        assert onnx_checks.check_model_bytes(serialize(model), "m.onnx") == {}


def test_protobuf_is_bounded_before_it_is_parsed(refuse, monkeypatch):
    """Fields are counted and nesting measured on the bytes, before the parser
    builds them (10 MB of empty nodes would take it to 770 MB)."""

    def never_parsed(data):
        raise AssertionError("the file was parsed")

    monkeypatch.setattr(onnx, "load_model_from_string", never_parsed)
    monkeypatch.setattr(onnx_checks, "_MAX_WIRE_VALUES", 1_000)
    identities = [helper.make_node("Identity", ["w"], ["w"]) for _ in range(400)]
    line = refuse(classifier([constant(), *identities]))
    assert "refused: it holds over 1,000 protobuf fields" in line

    graph = b""  # in a node's attribute of a graph, 40 times: 121 messages deep
    for _ in range(40):
        graph = message(1, message(5, message(6, graph)))
    line = refuse(message(7, graph))
    assert "refused: its messages nest over 100 deep" in line


def message(number: int, payload: bytes) -> bytes:
    """Field ``number`` holding the serialised message ``payload``."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes([*out, value])


def test_fields_unknown_to_onnx_are_refused(refuse):
    """A field the installed onnx cannot see could hide a tensor from the
    check that ONNX Runtime's own schema would read."""
    field_99 = b"\x98\x06\x01"  # ModelProto field 99, a varint 1
    line = refuse(serialize(classifier([constant()])) + field_99)
    assert "not an ONNX model (ModelProto has no field 99)" in line


def test_a_fifo_is_refused_without_blocking(tmp_path: Path, capsys):
    image = tmp_path / "a.png"
    Image.new("RGB", (7, 5)).save(image)
    fifo = tmp_path / "m.onnx"
    os.mkfifo(fifo)
    assert predict.main(["--onnx", str(fifo), str(image)]) == 2
    assert f"{fifo}: not a regular file" in error_line(capsys)
