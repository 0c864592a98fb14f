"""The tests' zygote (tests/zygote.py) ends a command as a new interpreter
would, torchrun's workers included, and it does serve: where it falls back
to new interpreters nothing fails, the suite only takes minutes longer."""

from __future__ import annotations

import sys
import time

import pytest
from helpers import (
    descendants,
    kill_session,
    process_table,
    python_command,
    run_command,
    run_python,
    start,
    the_zygote,
)

pytestmark = pytest.mark.slow

# Says whether it was forked from the zygote (torch imported before its first
# line), then does what its first argument asks.
SCRIPT = """\
import os, signal, sys, time
print("preloaded", "torch" in sys.modules, os.environ.get("RANK"), flush=True)
what = sys.argv[1]
print("out", sys.argv[2:])
print("err", file=sys.stderr)
if what == "raise":
    raise ValueError("the script's own error")
if what == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if what == "wait":  # rank 0 fails, rank 1 waits for a signal
    if os.environ["RANK"] == "0":
        sys.exit(3)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(print("rank 1: SIGTERM")))
    time.sleep(300)
if what == "sleep":
    time.sleep(300)
sys.exit(int(what) if what.isdigit() else 0)
"""

# What torchrun gets before the script: workers forked from the zygote.
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


@pytest.fixture
def script(tmp_path) -> str:
    path = tmp_path / "script.py"
    path.write_text(SCRIPT)
    return str(path)


def _workers() -> list[str]:
    return [*TORCHRUN, "--no-python", *the_zygote().worker_command()]


@pytest.mark.parametrize("what", ["0", "3", "raise", "kill"])
def test_a_command_ends_as_in_a_new_interpreter(script, what):
    forked = run_python([script, what, "a b", "c"])
    new = run_command([sys.executable, script, what, "a b", "c"])
    assert forked.stdout.splitlines()[0] == "preloaded True None", the_zygote().refused
    assert new.stdout.splitlines()[0] == "preloaded False None"
    expected = {"0": 0, "3": 3, "raise": 1, "kill": -9}[what]
    assert forked.returncode == new.returncode == expected
    assert forked.stdout.splitlines()[1:] == new.stdout.splitlines()[1:]
    # A traceback's last line (its frames differ: runpy's in the zygote).
    assert forked.stderr.splitlines()[-1] == new.stderr.splitlines()[-1]


def test_it_forks_after_in_process_runs_and_refuses_other_variables(
    script, monkeypatch
):
    # What the engine and imports set in the pytest worker when tests run them
    # in-process: read at run time only, so the zygote still serves.
    for name in ("CUBLAS_WORKSPACE_CONFIG", "KINETO_LOG_LEVEL"):
        monkeypatch.setenv(name, "set in-process")
    result = run_python([*_workers(), script, "0"])
    assert result.returncode == 0, result.stderr
    lines = sorted(line for line in result.stdout.splitlines() if "preloaded" in line)
    assert lines == ["preloaded True 0", "preloaded True 1"], the_zygote().refused
    # Any other variable may be read at import: a new interpreter, and workers.
    monkeypatch.setenv("DISTRIBUUUU_UNKNOWN", "1")
    with pytest.warns(UserWarning, match="refused .*DISTRIBUUUU_UNKNOWN"):
        result = run_python([*_workers(), script, "0"])
    lines = sorted(line for line in result.stdout.splitlines() if "preloaded" in line)
    assert lines == ["preloaded False 0", "preloaded False 1"]


def test_torchrun_stops_a_forked_worker_with_sigterm(script):
    """Rank 0 fails; torchrun sends SIGTERM to rank 1's client, which passes
    it on to the forked worker."""
    tic = time.monotonic()
    result = run_python([*_workers(), script, "wait"], timeout=120)
    assert result.returncode != 0
    assert "preloaded True 1" in result.stdout
    assert "rank 1: SIGTERM" in result.stdout
    assert time.monotonic() - tic < 60


def test_a_started_run_is_killed_whole_its_forked_workers_included(script):
    """helpers.python_command: torchrun and its 2 workers, each forked for a
    client; the tests' process walks see each as its client's child, so that
    kill_session ends them all (as the tests' SIGKILLs mid-run need)."""
    proc = start(python_command([*_workers(), script, "sleep"]))
    try:
        deadline = time.monotonic() + 60
        while len(forked := the_zygote().workers()) < 3:  # torchrun, 2 ranks
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        assert set(forked.values()) <= set(descendants(proc.pid))
    finally:
        kill_session(proc)
    deadline = time.monotonic() + 10
    while set(forked.values()) & {p for p, _, _, s in process_table() if s != "Z"}:
        assert time.monotonic() < deadline, "a forked process outlived the kill"
        time.sleep(0.05)
