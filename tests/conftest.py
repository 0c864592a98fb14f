"""pytest hooks: one torch thread per process (the markers are registered in
.pytest.ini; what the tests share is in helpers.py)."""

from __future__ import annotations

import os

import torch


def pytest_configure(config) -> None:
    """One torch thread per process, in the tests and every run they start: the
    README runs two test files at a time (``pytest -n 2``), and on a 2-core
    machine more threads would only wait for each other."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
