"""Crafted DeepSpeed checkpoints never run code.

DeepSpeed loads its files with ``torch.load(weights_only=False)``, through
torch's own zip reader.  The files under ``fixtures/deepspeed_files/`` are
genuine, every kind DeepSpeed writes: one SGD step of a 2 x 2 linear layer
saved by DeepSpeed 0.19.8 at ZeRO stage 2 (model states, optimizer states),
stage 3 (both per rank) and stage 2 in bf16 (``bf16_`` optimizer states), on
CPU, by ``tests/fixtures/deepspeed_files/make_fixtures.py``.  Each crafted
file here is one of them rebuilt around a pickle that would create a marker
file, so that a reader other than torch's sees the genuine pickle while
``torch.load`` runs the other.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import shutil
import struct
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
from helpers import TINY, call_main, needs_deepspeed
from test_hostile import assert_one_error_line, snapshot

from distribuuuu.checkpoint import check_deepspeed_files
from distribuuuu.checkpoint.deepspeed_files import torch_pickle_of, weights_only_loads
from distribuuuu.checkpoint.format import DEEPSPEED, DEEPSPEED_LAYOUT
from distribuuuu.config import get_cfg
from distribuuuu.engine.specs import strategy_spec
from distribuuuu.errors import RefusedCheckpointError

FIXTURES = Path(__file__).parents[1] / "fixtures" / "deepspeed_files"
# Every kind of file, as (layout folder, file name).
FILE_KINDS = sorted((path.parent.name, path.name) for path in FIXTURES.glob("*/*.pt"))
assert len(FILE_KINDS) == 6, f"the fixtures in {FIXTURES} are incomplete"


class _Marker:
    """Pickles as a call that creates a file when unpickled."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


# --- a zip written record by record ---------------------------------------- #
Records = list[tuple[str, bytes]]


def _local(name: str, data: bytes) -> bytes:
    encoded = name.encode()
    header = struct.pack(
        "<4s5H3L2H", b"PK\x03\x04", 20, 0x800, 0, 0, 0, zlib.crc32(data),
        len(data), len(data), len(encoded), 0,
    )  # fmt: skip
    return header + encoded + data


def _central(name: str, data: bytes, offset: int) -> bytes:
    encoded = name.encode()
    header = struct.pack(
        "<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0x800, 0, 0, 0, zlib.crc32(data),
        len(data), len(data), len(encoded), 0, 0, 0, 0, 0, offset,
    )  # fmt: skip
    return header + encoded


def _central_zip64(name: str, data: bytes, offset: int) -> bytes:
    """An entry whose sizes and offset are in its zip64 extra field, as
    torch.save writes them past 4 GiB."""
    encoded = name.encode()
    extra = struct.pack("<2H3Q", 1, 24, len(data), len(data), offset)
    header = struct.pack(
        "<4s6H3L5H2L", b"PK\x01\x02", 45, 45, 0x800, 0, 0, 0, zlib.crc32(data),
        0xFFFFFFFF, 0xFFFFFFFF, len(encoded), len(extra), 0, 0, 0, 0, 0xFFFFFFFF,
    )  # fmt: skip
    return header + encoded + extra


def _end(count: int, size: int, start: int, at: int, comment: bytes = b"") -> bytes:
    """The zip64 end record (at byte ``at``), its locator and the end record,
    as torch.save writes them."""
    zip64 = struct.pack(
        "<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, size, start
    )
    locator = struct.pack("<4sLQL", b"PK\x06\x07", 0, at, 1)
    end = struct.pack(
        "<4s4H2LH", b"PK\x05\x06", 0, 0, count, count, size, start, len(comment)
    )
    return zip64 + locator + end + comment


Listed = list[tuple[str, bytes, int]]  # name, data, offset of its local header


def lay_out(records: Records) -> tuple[bytes, Listed]:
    """``records`` one after the other, and where each starts."""
    body, listed = bytearray(), []
    for name, data in records:
        listed.append((name, data, len(body)))
        body += _local(name, data)
    return bytes(body), listed


def finish(body: bytes, listed: Listed) -> bytes:
    """``body``, then a central directory of ``listed`` and the end records."""
    directory = b"".join(_central(*entry) for entry in listed)
    start, size = len(body), len(directory)
    return body + directory + _end(len(listed), size, start, start + size)


def build_zip(records: Records) -> bytes:
    """A zip of ``records`` laid out as torch.save lays out its files."""
    return finish(*lay_out(records))


def two_directories(shown: Records, hidden: Records) -> bytes:
    """Python's zipfile reads ``shown``, torch's reader ``hidden``.

    Both take the central directory's size and start from the zip64 record.
    torch reads the directory where the start says (listing ``hidden``);
    zipfile reads the one just before the end records (listing ``shown``)
    and shifts every offset by the distance between the two.
    """
    body, listed = lay_out(hidden)
    size = len(b"".join(_central(*entry) for entry in listed))
    body += b"\0" * size  # keeps zipfile's shifted offsets >= 0
    more, shown_listed = lay_out(shown)
    shown_listed = [(n, d, o + len(body) - size) for n, d, o in shown_listed]
    start = len(body) + len(more)
    directories = b"".join(_central(*e) for e in [*listed, *shown_listed])
    assert len(directories) == 2 * size  # the same names, the same sizes
    end = _end(len(shown), size, start, start + 2 * size)
    return body + more + directories + end


def genuine(kind: tuple[str, str]) -> Records:
    """The records of a fixture file, in its order."""
    with zipfile.ZipFile(FIXTURES / kind[0] / kind[1]) as archive:
        return [(info.filename, archive.read(info)) for info in archive.infolist()]


def with_pickle(records: Records, pickled: bytes) -> Records:
    """``records`` with ``pickled`` as their data.pkl."""
    return [(n, pickled if n.endswith("/data.pkl") else d) for n, d in records]


def payload(marker: Path) -> bytes:
    return pickle.dumps({"module": _Marker(marker)}, protocol=2)


def crafted(kind: str, records: Records, marker: Path) -> bytes:
    """A crafted file of ``kind`` around a fixture's ``records``."""
    hostile = with_pickle(records, payload(marker))
    archive = records[0][0].split("/")[0]
    if kind == "two-directories":
        return two_directories(records, hostile)
    if kind == "pickle-before-the-zip":  # torch.load's legacy format then
        return payload(marker) + build_zip(records)
    if kind == "name-twice":
        return build_zip([*records, hostile[0]])
    if kind == "name-in-another-case":
        return build_zip([*records, (f"{archive}/DATA.PKL", payload(marker))])
    if kind == "entry-inside-another":
        inner = (f"{archive}/inner", b"x")
        body, listed = lay_out([*records, (f"{archive}/padding", _local(*inner))])
        return finish(body, [*listed, (*inner, body.index(_local(*inner)))])
    if kind == "bytes-between-entries":
        unlisted = (f"{archive}/unlisted", b"junk")
        body, listed = lay_out([records[0], unlisted, *records[1:]])
        return finish(body, [entry for entry in listed if entry[0] != unlisted[0]])
    if kind == "local-name-differs":
        data = build_zip(records)
        local = records[-1][0].encode()
        return data.replace(local, local[:-1] + b"X", 1)
    if kind == "zip-comment":
        data = build_zip(records)
        return data[:-2] + struct.pack("<H", 4) + b"note"
    if kind == "torchscript":
        return build_zip([*records, (f"{archive}/constants.pkl", payload(marker))])
    raise ValueError(kind)


EXPLOITS = ["two-directories", "pickle-before-the-zip"]
# A crafted layout -> words of the reason it is refused.
LAYOUTS = {
    "name-twice": "twice",
    "name-in-another-case": "twice",
    "entry-inside-another": "overlaps the part after it",
    "bytes-between-entries": "belong to none",
    "local-name-differs": "says otherwise",
    "zip-comment": "does not end with a zip's end record",
    "torchscript": "TorchScript archive",
}


def tag_folder(parent: Path, kind: tuple[str, str], data: bytes) -> Path:
    """``parent/ckpt_ep_0001.ds``, its tag folder holding the genuine files of
    ``kind``'s layout, the file of ``kind`` replaced by ``data``."""
    folder = parent / "ckpt_ep_0001.ds"
    shutil.copytree(FIXTURES / kind[0], folder / "zero")
    (folder / "zero" / kind[1]).write_bytes(data)
    return folder


def _id(kind: tuple[str, str]) -> str:
    return "/".join(kind)


@pytest.mark.parametrize("kind", FILE_KINDS, ids=_id)
def test_genuine_files_and_their_copies_rebuilt_here_pass(kind, tmp_path):
    """As DeepSpeed wrote them, and rebuilt by this test's zip writer (as the
    crafted files are), with nothing crafted."""
    check_deepspeed_files(
        str(tag_folder(tmp_path, kind, (FIXTURES / _id(kind)).read_bytes()))
    )
    rebuilt = tag_folder(tmp_path / "rebuilt", kind, build_zip(genuine(kind)))
    check_deepspeed_files(str(rebuilt))


def test_entries_with_zip64_sizes_pass(tmp_path):
    """Sizes and offsets in zip64 extra fields (files past 4 GiB) are read."""
    kind = FILE_KINDS[0]
    body, listed = lay_out(genuine(kind))
    directory = b"".join(_central_zip64(*entry) for entry in listed)
    start, size = len(body), len(directory)
    data = body + directory + _end(len(listed), size, start, start + size)
    assert torch.load(io.BytesIO(data), weights_only=True)["ds_version"] == "0.19.8"
    check_deepspeed_files(str(tag_folder(tmp_path, kind, data)))


@pytest.mark.parametrize("exploit", EXPLOITS)
def test_the_crafted_files_run_code_under_deepspeeds_torch_load(exploit, tmp_path):
    """The exploits are real: Python's zipfile, which the check once used,
    sees the genuine pickle; torch.load(weights_only=False), as DeepSpeed
    calls it, runs the other."""
    marker = tmp_path / "ran"
    records = genuine(FILE_KINDS[0])
    path = tmp_path / "file.pt"
    path.write_bytes(crafted(exploit, records, marker))
    with zipfile.ZipFile(path) as archive:
        assert archive.read(records[0][0]) == records[0][1]  # data.pkl
    with contextlib.suppress(Exception):  # the legacy format fails after it
        torch.load(path, weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize("kind", FILE_KINDS, ids=_id)
@pytest.mark.parametrize("exploit", EXPLOITS)
def test_every_kind_of_deepspeed_file_crafted_is_refused(exploit, kind, tmp_path):
    marker = tmp_path / "ran"
    folder = tag_folder(tmp_path, kind, crafted(exploit, genuine(kind), marker))
    with pytest.raises(RefusedCheckpointError, match="is not a file torch.save wrote"):
        check_deepspeed_files(str(folder))
    assert not marker.exists()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_zips_that_readers_could_read_differently_are_refused(layout, tmp_path):
    kind = ("zero2", "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    marker = tmp_path / "ran"
    folder = tag_folder(tmp_path, kind, crafted(layout, genuine(kind), marker))
    with pytest.raises(RefusedCheckpointError) as caught:
        check_deepspeed_files(str(folder))
    assert kind[1] in str(caught.value) and LAYOUTS[layout] in str(caught.value)
    assert not marker.exists()


def test_auto_resume_refuses_a_crafted_deepspeed_file_with_exit_2(tmp_path):
    """Pre-flight, before anything is written: one error line, OUT_DIR as it was."""
    marker, out = tmp_path / "ran", tmp_path / "out"
    checkpoints = out / "checkpoints"
    kind = ("zero2", "mp_rank_00_model_states.pt")
    folder = tag_folder(
        checkpoints, kind, crafted("two-directories", genuine(kind), marker)
    )
    state = {"epoch": 1, "consumed": 0, "model": {}, DEEPSPEED: folder.name}
    torch.save({**state, DEEPSPEED_LAYOUT: [2, 1]}, checkpoints / "ckpt_ep_0001.pth")
    before = snapshot(out)
    result = call_main(*TINY, "OUT_DIR", str(out))
    assert "refused" in assert_one_error_line(result, 2, [kind[1]])
    assert not marker.exists() and snapshot(out) == before


def test_the_pickle_checked_is_the_one_torch_load_unpickles(tmp_path):
    """The check reads data.pkl through torch's own (private) zip reader,
    torch._C.PyTorchFileReader: where Python's zipfile sees another pickle,
    it sees torch.load's.  Fails if torch's reader changes."""
    records = genuine(FILE_KINDS[0])
    other = with_pickle(records, pickle.dumps({"seen by": "torch"}, protocol=2))
    path = tmp_path / "file.pt"
    path.write_bytes(two_directories(records, other))
    with open(path, "rb") as file:
        checked = pickle.loads(torch_pickle_of(file))
    assert checked == torch.load(path, weights_only=True) == {"seen by": "torch"}


# --- DeepSpeed's own loads, weights-only ----------------------------------- #
FORCE = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
FORCE_NOT = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"


@pytest.fixture
def deepspeed_loader(monkeypatch):
    """DeepSpeed's TorchCheckpointEngine, through which its engine loads every
    checkpoint file (on CPU; a user's TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD set)."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.delenv(FORCE, raising=False)
    monkeypatch.setenv(FORCE_NOT, "1")
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import (
        TorchCheckpointEngine,
    )

    return TorchCheckpointEngine()


@needs_deepspeed
def test_deepspeeds_own_load_reads_genuine_files_and_refuses_code(
    deepspeed_loader, tmp_path
):
    """Inside weights_only_loads DeepSpeed's load (weights_only=False) builds
    DeepSpeed's classes and refuses anything else; the environment is as it
    was after it."""
    marker = tmp_path / "ran"
    with weights_only_loads(str(tmp_path)):
        for kind in FILE_KINDS:
            state = deepspeed_loader.load(str(FIXTURES / _id(kind)), map_location="cpu")
            assert state["ds_version"] == "0.19.8"
    assert type(state["optimizer_state_dict"]["loss_scaler"]).__name__ == "LossScaler"
    for exploit in EXPLOITS:
        path = tmp_path / f"{exploit}.pt"
        path.write_bytes(crafted(exploit, genuine(FILE_KINDS[0]), marker))
        with (
            pytest.raises(
                RefusedCheckpointError, match=r"code or objects \(posix.system\)"
            ),
            weights_only_loads(str(tmp_path)),
        ):
            deepspeed_loader.load(str(path), map_location="cpu")
    assert not marker.exists()
    assert FORCE not in os.environ and os.environ[FORCE_NOT] == "1"


@needs_deepspeed
def test_resume_loads_deepspeeds_files_weights_only(deepspeed_loader, tmp_path):
    """DeepSpeedStrategy.load_weights, the check before it skipped (a file
    changed after it): the engine's load_checkpoint, which reads the folder
    through its checkpoint engine, runs no code."""
    from distribuuuu.checkpoint.format import SavedRun
    from distribuuuu.strategies.deepspeed import DeepSpeedStrategy

    class Engine:
        """What DeepSpeed's load_checkpoint does with the files."""

        def load_checkpoint(self, directory: str, tag: str, **kwargs):
            for name in sorted(os.listdir(os.path.join(directory, tag))):
                path = os.path.join(directory, tag, name)
                deepspeed_loader.load(path, map_location="cpu")
            return directory, {}

    cfg = get_cfg()
    cfg.merge_from_list(
        ["DIST.STRATEGY", "deepspeed", "DIST.DEEPSPEED.ZERO_STAGE", "2"]
    )
    strategy = DeepSpeedStrategy(strategy_spec(cfg, torch.device("cpu")))
    marker = tmp_path / "ran"
    kind = ("zero2", "mp_rank_00_model_states.pt")
    for name, data in [
        ("genuine", (FIXTURES / _id(kind)).read_bytes()),
        ("crafted", crafted("two-directories", genuine(kind), marker)),
    ]:
        folder = tag_folder(tmp_path / name, kind, data)
        state = {"epoch": 1, DEEPSPEED: folder.name, DEEPSPEED_LAYOUT: [2, 1]}
        saved = SavedRun(str(folder.parent / "ckpt_ep_0001.pth"), state)
        if name == "genuine":
            assert strategy.load_weights(Engine(), None, saved, None) is False
            continue
        with pytest.raises(RefusedCheckpointError, match="posix.system"):
            strategy.load_weights(Engine(), None, saved, None)
    assert not marker.exists()
