"""pytest hooks: one torch thread per process; the namespaced nodes of the
multi-node tests (the markers are registered in .pytest.ini; what the tests
share is in helpers.py)."""

from __future__ import annotations

import hashlib
import os
import sys

import pytest
import torch

from distribuuuu.bench.netsim import namespaced_nodes, why_unavailable


def pytest_configure(config) -> None:
    """One torch thread per process, in the tests and every run they start: the
    README runs two test files at a time (``pytest -n 2``), and on a 2-core
    machine more threads would only wait for each other."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    # DeepSpeed compiles its CPU communication op at its first use on a CPU
    # into torch's extension cache, whose default folder names the Python
    # and CUDA versions but not the venv: two venvs (a clone's, the torch
    # 2.11 one of .ci/run) would rebuild it over each other, minutes each.
    venv = hashlib.sha1(sys.prefix.encode()).hexdigest()[:12]
    cache = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    folder = os.path.join(cache, "torch_extensions", f"venv-{venv}")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", folder)


# The skip reasons of tests that run on CUDA only.
NEEDS_CUDA = ("needs CUDA", "needs 2 or more CUDA")


def pytest_collection_modifyitems(config, items) -> None:
    """A test that skips without CUDA must carry the ``cuda`` marker, so that
    ``pytest -m cuda`` (tools/gpu_check.sh on the GPU machine) runs it."""
    unmarked = [
        item.nodeid
        for item in items
        if item.get_closest_marker("cuda") is None
        and any(
            str(mark.kwargs.get("reason", "")).startswith(NEEDS_CUDA)
            for mark in item.iter_markers("skipif")
        )
    ]
    if unmarked:
        raise pytest.UsageError(
            "these tests skip without CUDA but lack @pytest.mark.cuda: "
            + ", ".join(unmarked)
        )


@pytest.fixture(scope="session")
def netsim_ready() -> None:
    """Skip, naming why, where this machine cannot make namespaced nodes
    (tools/netsim.sh: root, iproute2, and network namespaces, bridges, veth
    pairs and tc tbf in the kernel)."""
    reason = why_unavailable()
    if reason:
        pytest.skip(f"namespaced nodes (tools/netsim.sh): {reason}")


@pytest.fixture(scope="module")
def two_nodes(netsim_ready):
    """Two namespaced nodes whose links are shaped to 1000 Mbit/s, shared by
    a test module and removed after it (also when a test fails)."""
    with namespaced_nodes(2, 1000) as nodes:
        yield nodes
