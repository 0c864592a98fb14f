"""pytest hooks: one torch thread per process; each test's environment
restored after it; the namespaced nodes of the multi-node tests (the markers
are registered in .pytest.ini; what the tests share is in helpers.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from distribuuuu.bench.netsim import namespaced_nodes, why_unavailable


def pytest_configure(config) -> None:
    """One torch thread per process, in the tests and every run they start: the
    README runs two test files at a time (``pytest -n 2``), and on a 2-core
    machine more threads would only wait for each other."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# The skip reasons of tests that run on CUDA only.
NEEDS_CUDA = ("needs CUDA", "needs 2 or more CUDA")


def pytest_collection_modifyitems(config, items) -> None:
    """A test that skips without CUDA must carry the ``cuda`` marker, so that
    ``pytest -m cuda`` (tools/gpu_check.sh on the GPU machine) runs it; the
    script looks for the marker's name in the modules, so it must be there."""
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
    # Not at the top: helpers reads the environment pytest_configure sets.
    from helpers import import_tool

    marked = {str(item.path) for item in items if item.get_closest_marker("cuda")}
    gpu_check = import_tool("gpu_check")
    if unfound := marked - set(gpu_check.cuda_test_files(os.path.dirname(__file__))):
        raise pytest.UsageError(
            f"these modules mark cuda tests without the words {gpu_check.CUDA_MARK} "
            "that tools/gpu_check.sh looks for: " + ", ".join(sorted(unfound))
        )


@pytest.fixture(autouse=True)
def _environment_as_it_was() -> Iterator[None]:
    """What a test sets in this process's environment (DeepSpeed's strategy
    sets LOCAL_RANK, torch its run-time variables) ends with it: no later
    test, and no run a later test starts, inherits it."""
    saved = dict(os.environ)
    yield
    for name in os.environ.keys() - saved.keys():
        del os.environ[name]
    for name, value in saved.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


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
