"""The metrics files a run appends to in OUT_DIR (metrics.jsonl, the csv
tracker's metrics_<split>.csv) never write through a link, and a file there
that cannot be read never stops a run: it is set aside with a warning."""

from __future__ import annotations

import csv
import logging
import os
from pathlib import Path

import pytest

from distribuuuu.reporting.trackers import CsvTracker
from distribuuuu.reporting.writer import MetricsWriter

TRAIN = {"split": "train", "epoch": 1, "iter": 2, "loss": 2.5}
VAL = {"split": "val", "epoch": 1, "top1": 40.0, "loss": 2.0}


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    """A file outside OUT_DIR that a planted link points to."""
    path = tmp_path / "secret.txt"
    path.write_text("do not touch\n")
    return path


@pytest.mark.parametrize("record", [TRAIN, VAL], ids=["train", "val"])
def test_csv_tracker_never_writes_through_a_link(record, tmp_path, secret, caplog):
    out = tmp_path / "out"
    out.mkdir()
    planted = out / f"metrics_{record['split']}.csv"
    planted.symlink_to(secret)
    with caplog.at_level(logging.WARNING, logger="distribuuuu"):
        CsvTracker(str(out)).log(record, {"x": 1.0}, step=2)
    assert secret.read_text() == "do not touch\n"
    assert not planted.is_symlink()
    (row,) = read_csv(planted)
    assert float(row["loss"]) == record["loss"]
    aside = out / f"{planted.name}.old"  # the link itself, its target unchanged
    assert aside.is_symlink() and aside.resolve() == secret
    (line,) = warnings_of(caplog)
    assert "symbolic link" in line and planted.name + ".old" in line


def test_metrics_jsonl_is_never_written_through_a_link(tmp_path, secret, caplog):
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").symlink_to(secret)
    with caplog.at_level(logging.WARNING, logger="distribuuuu"):
        writer = MetricsWriter(str(out), True, [])
        writer.write(VAL, {"val/top1": 40.0}, 1)
        writer.close()
    assert secret.read_text() == "do not touch\n"
    assert not (out / "metrics.jsonl").is_symlink()
    assert '"top1": 40.0' in (out / "metrics.jsonl").read_text()
    (line,) = warnings_of(caplog)
    assert "symbolic link" in line


@pytest.mark.parametrize(
    "content",
    [
        b"\xff\xfe\x00l\x00o\x00s\x00s\x00\n",  # UTF-16, from a spreadsheet
        b"epoch,top1,loss\n1,\xff\xfe,2\n",  # a header, then a bad row
    ],
    ids=["from-the-start", "after-the-header"],
)
def test_unreadable_csv_is_set_aside_and_a_resume_goes_on(content, tmp_path, caplog):
    """The val csv is read at the first evaluation (the new ``samples`` field
    widens its header); a resumed run (a new tracker) then appends."""
    out = tmp_path / "out"
    out.mkdir()
    path = out / "metrics_val.csv"
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="distribuuuu"):
        CsvTracker(str(out)).log({**VAL, "samples": 101}, {"x": 1.0}, step=1)
        CsvTracker(str(out)).log({**VAL, "epoch": 2}, {"x": 1.0}, step=2)
    assert (out / "metrics_val.csv.old").read_bytes() == content
    rows = read_csv(path)
    assert [row["epoch"] for row in rows] == ["1", "2"]
    assert rows[1]["samples"] == ""
    (line,) = warnings_of(caplog)
    assert "cannot be read as a UTF-8 csv" in line and "metrics_val.csv.old" in line


def test_a_second_set_aside_file_gets_a_free_name(tmp_path, caplog):
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics_val.csv.old").write_text("kept\n")
    (out / "metrics_val.csv").write_bytes(b"\xff\n")
    with caplog.at_level(logging.WARNING, logger="distribuuuu"):
        CsvTracker(str(out)).log(VAL, {"x": 1.0}, step=1)
    assert (out / "metrics_val.csv.old").read_text() == "kept\n"
    assert (out / "metrics_val.csv.old2").read_bytes() == b"\xff\n"
    assert sorted(os.listdir(out)) == [
        "metrics_val.csv",
        "metrics_val.csv.old",
        "metrics_val.csv.old2",
    ]
