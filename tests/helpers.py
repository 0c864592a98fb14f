"""What the tests share: the real entry point run in a subprocess (always
reaped), real gloo ranks in spawned processes, the run options every test
uses, and readers of what a run writes."""

from __future__ import annotations

import contextlib
import glob
import importlib
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import traceback
import urllib.request
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from zygote import Zygote

from distribuuuu.dist.group import release_groups
from distribuuuu.dist.spawn import find_free_port, run_as_rank

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_NET = os.path.join(REPO, "tools", "train_net.py")
# A small, fast run of the embedded data set (seconds per epoch on 2 cores).
FAST = ["MODEL.ARCH", "resnet8", "TRAIN.PRINT_FREQ", "20"]
# One epoch of LeNet-5 on 256 synthetic images, validated on 101 (divisible by
# neither 2 nor 3): for tests of how a job starts, where the data do not matter.
TINY = [
    "MODEL.ARCH",
    "lenet5",
    "DATA.NAME",
    "synthetic",
    "DATA.SYNTHETIC_SIZE",
    "[256,101]",
    "TRAIN.BATCH_SIZE",
    "32",
    "OPTIM.MAX_EPOCH",
    "1",
    "TRAIN.PRINT_FREQ",
    "2",
]
TINY_VAL_SIZE = 101


def free_port() -> int:
    """A TCP port that was free a moment ago."""
    return find_free_port()


def run_command(
    cmd: list[str], timeout: float = 300, env: dict | None = None, **kwargs
):
    """Run ``cmd`` in its own process group; kill the whole group on time-out."""
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.Popen(
        cmd,
        cwd=kwargs.pop("cwd", REPO),
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        **kwargs,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout}s: {cmd}\n{out[-3000:]}\n{err[-3000:]}")
    finally:
        # reap anything the command left behind in its group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _default_sigint() -> None:
    # A shell without job control starts background commands with SIGINT
    # ignored, and the ignoring is inherited (CI run with `&`): the command
    # then gets Ctrl-C as a terminal would deliver it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(cmd: list[str], env: dict | None = None) -> subprocess.Popen:
    """Start ``cmd`` in a new session, with SIGINT's default action; stop it
    with :func:`kill_session`."""
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=_default_sigint,
    )


def process_table() -> list[tuple[int, int, int, str]]:
    """(pid, parent pid, session id, state) of every process, from /proc."""
    table = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            table.append((int(entry), int(fields[1]), int(fields[3]), fields[0]))
    return table


def descendants(pid: int) -> list[int]:
    """Every process started by ``pid``, directly or not: a worker forked by
    this pytest worker's zygote counts as its client's child (tests/zygote.py)."""
    children: dict[int, list[int]] = {}
    for child, parent, _, _ in process_table():
        children.setdefault(parent, []).append(child)
    if _zygote:
        for client, child in _zygote[0].workers().items():
            children.setdefault(client, []).append(child)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``, its process group and every descendant.

    torchrun starts its workers in sessions of their own, so killing the
    launcher's group alone would leave them running.
    """
    for target in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(target, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` and all it started, and reap ``proc``."""
    kill_tree(proc.pid)
    proc.communicate()


_zygote: list[Zygote] = []
# The worker's environment before any test changed it: the zygote's.
_WORKER_ENV = dict(os.environ)


def the_zygote() -> Zygote:
    """This pytest worker's zygote (tests/zygote.py), started at its first use."""
    if not _zygote:
        _zygote.append(Zygote(REPO, _WORKER_ENV))
    return _zygote[0]


def run_python(argv: list[str], timeout: float = 300, env: dict | None = None):
    """``python ARGV``, run to its end like :func:`run_command`, in a process
    forked from this worker's preloaded zygote (tests/zygote.py: no seconds
    of imports) where the environment allows, else in a new interpreter."""
    full_env = {**os.environ, **(env or {})}
    zygote = the_zygote()
    done = zygote.run(argv, timeout, full_env, kill_tree)
    if done is None:
        if leaked := set(zygote.refused) - set(env or {}):
            warnings.warn(
                f"the zygote refused a command for {sorted(leaked)}, set in this "
                "pytest worker: a new interpreter runs it (read only at run time? "
                "then add it to IGNORED in tests/zygote.py)",
                stacklevel=2,
            )
        return run_command([sys.executable, *argv], timeout=timeout, env=env)
    code, out, err = done
    if code is None:
        pytest.fail(f"timed out after {timeout}s: {argv}\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess([sys.executable, *argv], code, out, err)


def train_net(*args: str, timeout: float = 300, env: dict | None = None):
    """``python tools/train_net.py ARGS`` as a user would run it."""
    return run_python([TRAIN_NET, *args], timeout=timeout, env=env)


def torchrun_argv(
    nproc: int, args: list[str], *options: str, script: str = TRAIN_NET
) -> list[str]:
    """``-m torch.distributed.run --standalone --nproc_per_node=N OPTIONS
    tools/train_net.py ARGS`` (or another ``script``), whose workers are forked
    from the zygote where it can run them."""
    argv = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    workers = ["--no-python", *the_zygote().worker_command()]
    return [*argv, *options, *workers, script, *args]


def torchrun(nproc: int, *args: str, timeout: float = 300):
    """``torchrun --standalone --nproc_per_node=N tools/train_net.py ARGS``;
    it, and its workers, forked from the zygote where it can run them."""
    return run_python(torchrun_argv(nproc, list(args)), timeout)


def python_command(argv: list[str]) -> list[str]:
    """A command for :func:`start` that is ``python ARGV``: a client whose
    process is forked from this worker's zygote (tests/zygote.py), which
    passes on the signals it gets and ends as that process ends, or a new
    interpreter where the zygote will not run it.  :func:`kill_session`,
    :func:`descendants` and :func:`worker_pid` see through the client."""
    zygote = the_zygote()
    if not zygote.ready():
        return [sys.executable, *argv]
    return [*zygote.worker_command(), *argv]


def import_tool(name: str):
    """tools/<name>.py imported as a module."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def import_train_net():
    """tools/train_net.py imported as a module."""
    return import_tool("train_net")


def call_main(*args: str) -> subprocess.CompletedProcess:
    """``main(ARGS)`` of tools/train_net.py in this process.

    For input refused before anything runs (exit 2) it answers what the command
    answers, without the seconds of a new interpreter importing torch;
    test_hostile.py::test_debug_adds_the_traceback runs the command itself.
    """
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = import_train_net().main(list(args))
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def refused(out_dir: str, *args: str) -> str:
    """The one ``error:`` line of ``main(ARGS OUT_DIR out_dir)``, which must
    exit 2 before creating ``out_dir``."""
    result = call_main(*args, "OUT_DIR", out_dir)
    assert result.returncode == 2, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    assert not os.path.exists(out_dir)
    return errors[0]


def read_text(*parts: str) -> str:
    """The text of the file at ``os.path.join(*parts)``."""
    with open(os.path.join(*parts), encoding="utf-8") as f:
        return f.read()


def read_metrics(out_dir: str, split: str | None = None) -> list[dict]:
    """The records of ``OUT_DIR/metrics.jsonl`` (of one split if given)."""
    with open(os.path.join(out_dir, "metrics.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    return [r for r in records if split is None or r.get("split") == split]


def last_checkpoint_weights(out_dir: str) -> dict:
    """The model weights of the checkpoint ``OUT_DIR/checkpoints/last`` names."""
    last = read_text(out_dir, "checkpoints", "last").strip()
    path = os.path.join(out_dir, "checkpoints", last)
    return torch.load(path, weights_only=True)["model"]


def keep_only_checkpoint(out_dir: str, name: str) -> None:
    """Delete every training checkpoint of ``out_dir`` but ``name``, which
    ``last`` then names: the run stopped there."""
    checkpoints = os.path.join(out_dir, "checkpoints")
    for other in os.listdir(checkpoints):
        if other.startswith("ckpt_") and other != name:
            os.remove(os.path.join(checkpoints, other))
    with open(os.path.join(checkpoints, "last"), "w", encoding="utf-8") as f:
        f.write(f"{name}\n")


def assert_ok(result: subprocess.CompletedProcess) -> None:
    """Fail with the command's output when it did not exit 0."""
    assert result.returncode == 0, (
        f"exit {result.returncode}\n--- stdout\n{result.stdout[-4000:]}"
        f"\n--- stderr\n{result.stderr[-4000:]}"
    )


def strategy_for(name: str, syncbn: bool = False, device="cpu", amp_dtype=None, **keys):
    """The strategy ``DIST.STRATEGY name`` of the default config on ``device``
    (``keys``: more DIST values, e.g. ``FSDP_CPU_OFFLOAD=True``)."""
    from distribuuuu.config import get_cfg
    from distribuuuu.engine.specs import strategy_spec
    from distribuuuu.strategies import build_strategy

    cfg = get_cfg()
    cfg.DIST.STRATEGY, cfg.MODEL.SYNCBN = name, syncbn
    for key, value in keys.items():
        setattr(cfg.DIST, key, value)
    spec = strategy_spec(cfg, torch.device(device), amp_dtype=amp_dtype)
    return build_strategy(spec)


def _entry(
    rank: int, world: int, port: int, fn, args: tuple, out_dir: str, env: dict
) -> None:
    os.environ.clear()  # the caller's, as a spawned process would inherit it
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        if dist.is_initialized():  # fn may have left it (a run of train_net)
            dist.destroy_process_group()
        # Device meshes keep gloo groups alive past exit, which can abort the
        # finished process (see distribuuuu.dist.group.release_groups).
        release_groups()


def run_parts(parts: dict) -> dict:
    """Each part's result by name; a part that raised keeps its traceback
    instead, so that its tests fail with it and the others get answers."""
    results = {}
    for name, part in parts.items():
        try:
            results[name] = part()
        except Exception:
            results[name] = traceback.format_exc()
    return results


# What the ranks of run_on_ranks import once, in their fork server.
RANK_PRELOAD = ["torch", "torchvision", "distribuuuu.strategies", "helpers"]


def run_on_ranks(world: int, fn, args: tuple, out_dir: str) -> list:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks; their results in order.

    The ranks are forked from a server that imported torch once (a fork
    server: a fresh single-threaded interpreter, not this process), instead
    of each importing it anew as a spawned process would.
    """
    os.makedirs(out_dir, exist_ok=True)
    _fork(world, _entry, fn, args, str(out_dir), dict(os.environ))
    return [
        torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=True)
        for r in range(world)
    ]


def _launched(rank: int, world: int, port: int, fn, args: tuple, env: dict) -> None:
    os.environ.clear()
    os.environ.update(env)  # the server's is its own, from when it started
    torch.set_num_threads(1)
    run_as_rank(rank, world, port, fn, args)


def run_launched(world: int, fn, args: tuple) -> None:
    """``fn(*args)`` on ``world`` processes that have the environment torchrun
    (and ``--num-procs``) gives its workers, no process group yet; forked from
    the server of :func:`run_on_ranks`."""
    _fork(world, _launched, fn, args, dict(os.environ))


def _fork(world: int, entry, *args) -> None:
    """``entry(rank, world, port, *args)`` in ``world`` processes forked from
    the fork server that imports :data:`RANK_PRELOAD`; waits for all."""
    mp.get_context("forkserver").set_forkserver_preload(RANK_PRELOAD)
    mp.start_processes(
        entry,
        args=(world, free_port(), *args),
        nprocs=world,
        join=True,
        start_method="forkserver",
    )


def error_line(capsys) -> str:
    """The one stderr line a tool's ``main`` printed (nothing on stdout)."""
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert captured.out == ""
    return lines[0]


class MlflowServer:
    """A real ``mlflow server`` on 127.0.0.1 with a sqlite backend and a
    local artifact store under ``root``; read what it stored back through
    :attr:`store_uri` and :attr:`artifacts` (without the server)."""

    def __init__(self, root: str):
        self.root = str(root)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.store_uri = f"sqlite:///{os.path.join(self.root, 'mlflow.db')}"
        self.artifacts = os.path.join(self.root, "artifacts")
        self.proc: subprocess.Popen | None = None
        self.startup_s = 0.0

    def start(self, timeout: float = 120) -> None:
        """Start it and wait until it answers /health (fail after ``timeout``)."""
        cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), "--workers", "1"]
        cmd += ["--backend-store-uri", self.store_uri]
        cmd += ["--artifacts-destination", self.artifacts]
        # The job runner (7 processes) serves nothing a run logs.
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        tic = time.monotonic()
        with open(os.path.join(self.root, "server.log"), "w") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=self.root, env=env, stdout=log, stderr=log,
                start_new_session=True,
            )  # fmt: skip
        while time.monotonic() - tic < timeout:
            if self.proc.poll() is not None:
                break
            health = self.url + "/health"
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(health, timeout=1) as reply,
            ):
                if reply.status == 200:
                    self.startup_s = time.monotonic() - tic
                    return
            time.sleep(0.2)
        self.stop()
        log = read_text(self.root, "server.log")
        pytest.fail(f"mlflow server did not start:\n{log}")

    def stop(self) -> None:
        """Kill it and everything it started, and reap it."""
        if self.proc is not None:
            kill_tree(self.proc.pid)
            self.proc.wait()


@contextlib.contextmanager
def mlflow_server(root: str):
    """A started :class:`MlflowServer`, always killed and reaped at the end."""
    server = MlflowServer(root)
    try:
        server.start()
        yield server
    finally:
        server.stop()


def slurm_ready() -> str:
    """Why the local Slurm cannot run a job ("" when it can)."""
    if shutil.which("srun") is None or shutil.which("sinfo") is None:
        return "Slurm is not installed (CI starts one: tools/slurm_local.sh up)"
    try:
        states = subprocess.run(
            ["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20
        ).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return "sinfo does not answer"
    if not any(s.rstrip("*") in ("idle", "mixed", "allocated") for s in states):
        return f"no usable Slurm node (sinfo: {states})"
    return ""


def worker_pid(torchrun_pid: int, rank: int) -> int:
    """The pid of the worker of ``rank`` that torchrun ``torchrun_pid`` started."""
    for pid in descendants(torchrun_pid):
        try:
            cmdline = read_text("/proc", str(pid), "cmdline")
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue
        is_worker = TRAIN_NET in cmdline and "torch.distributed.run" not in cmdline
        if is_worker and f"RANK={rank}".encode() in environ:
            # A zygote's client: the worker is the process forked for it.
            return the_zygote().workers().get(pid, pid)
    raise AssertionError(f"no rank {rank} worker found under {torchrun_pid}")


def _deepspeed_installed() -> bool:
    from distribuuuu.strategies.deepspeed import deepspeed_installed

    return deepspeed_installed()


# CI installs the dev extra, which brings DeepSpeed: there the tests must run.
needs_deepspeed = pytest.mark.skipif(
    not _deepspeed_installed() and not os.environ.get("CI"),
    reason="DeepSpeed is not installed (pip install -e '.[deepspeed]')",
)


# --- a run killed mid-way (SIGKILL to every process), then run again -------- #
# One epoch of resnet8 on 2,560 synthetic images, a checkpoint every 10 steps:
# 40 steps of global batch 64 (one process, or 2 ranks of one replica).
KILLED_RUN = [
    "MODEL.ARCH",
    "resnet8",
    "DATA.NAME",
    "synthetic",
    "DATA.SYNTHETIC_SIZE",
    "[2560,200]",
    "OPTIM.MAX_EPOCH",
    "1",
    "TRAIN.PRINT_FREQ",
    "20",
    "CHECKPOINT.PERIOD_ITERS",
    "10",
    "CHECKPOINT.KEEP",
    "0",
]


def launch_command(nproc: int, args: list[str]) -> list[str]:
    """``train_net.py ARGS`` on one process, or under torchrun on ``nproc``,
    for :func:`start` (:func:`python_command`)."""
    if nproc == 1:
        return python_command([TRAIN_NET, *args])
    return python_command(torchrun_argv(nproc, args))


def final_model(out_dir: str) -> dict:
    """The model of the run's last checkpoint (its shards read whole)."""
    from distribuuuu.checkpoint import load_full

    name = read_text(out_dir, "checkpoints", "last").strip()
    return load_full(os.path.join(out_dir, "checkpoints", name))["model"]


def wait_for_file(pattern: str, proc, seconds: float = 240) -> None:
    """Wait until a file matches the glob ``pattern`` (fail if ``proc`` ends
    or ``seconds`` pass first)."""
    deadline = time.time() + seconds
    while not glob.glob(pattern) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert glob.glob(pattern), f"{pattern} never appeared"


# A sitecustomize that makes every fsync wait 0.5 s (only those off the main
# thread, where ``BACKGROUND`` is true): a run under it cannot complete its
# next checkpoint within 0.5 s of the last, so that a kill lands before it.
_SLOW_FSYNC = """
import os, threading, time

_fsync = os.fsync

def _slow_fsync(fd):
    if not BACKGROUND or threading.current_thread() is not threading.main_thread():
        time.sleep(0.5)
    _fsync(fd)

os.fsync = _slow_fsync
"""


def slow_fsync_env(folder: str, background_only: bool = False) -> dict:
    """The environment of a run whose fsyncs are slow (see _SLOW_FSYNC):
    ``folder``, created, holds its sitecustomize."""
    os.makedirs(folder)
    with open(os.path.join(folder, "sitecustomize.py"), "w") as f:
        f.write(f"BACKGROUND = {background_only}\n{_SLOW_FSYNC}")
    python = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [folder, python]))}


def kill_mid_run(
    nproc: int,
    args: list[str],
    out: str,
    pattern: str,
    before: str,
    delay: float,
    env: dict | None = None,
) -> None:
    """Start the run, SIGKILL it (all processes) at a moment up to ``delay``
    s after a checkpoint matching ``pattern`` appears (drawn from a generator
    seeded by the arguments, so a failure repeats); check that checkpoint
    ``before`` was not reached."""
    proc = start(launch_command(nproc, args), env)
    seed = f"{nproc} {pattern}"
    pause = random.Random(seed).uniform(0.0, delay)
    # Shown with a failure's output, so that the moment can be replayed.
    print(f"SIGKILL {pause:.3f} s after {pattern} (random.Random({seed!r}))")
    try:
        wait_for_file(os.path.join(out, "checkpoints", pattern), proc)
        time.sleep(pause)
    finally:
        kill_session(proc)
    assert not os.path.exists(os.path.join(out, "checkpoints", before)), before


def sigkill_then_rerun_matches_uninterrupted(
    tmp_path,
    nproc: int,
    tear: bool,
    more: tuple[str, ...] = (),
    run: list[str] = KILLED_RUN,
    after: str = "ckpt_ep_0000_it_002*.pth",
) -> None:
    """Kill a run of :data:`KILLED_RUN` (every process) at a random moment
    after its second checkpoint; with ``tear``, also cut its newest checkpoint
    in half, as a crash while writing would without the atomic rename.  The
    rerun resumes (from the checkpoint before the torn one) and ends bitwise
    where an uninterrupted run ends.  ``more``: config overrides of all runs;
    ``run``: the run (its checkpoint ``after``, the glob of the second one,
    leaving as many steps to run as :data:`KILLED_RUN` does)."""
    reference, killed = str(tmp_path / "reference"), str(tmp_path / "killed")
    run = [*run, *more]
    launch = (lambda *a: torchrun(nproc, *a)) if nproc > 1 else train_net
    assert_ok(launch(*run, "OUT_DIR", reference))
    args = [*run, "OUT_DIR", killed]
    # 0.5 s at most: the rest of the epoch, 12 steps or more and the
    # validation, takes longer.
    kill_mid_run(nproc, args, killed, after, "ckpt_ep_0001.pth", 0.5)
    if tear:
        newest = max(glob.glob(os.path.join(killed, "checkpoints", "ckpt_*.pth")))
        with open(newest, "r+b") as f:
            f.truncate(os.path.getsize(newest) // 2)
    rerun = launch(*args)
    assert_ok(rerun)
    assert "resumed from" in rerun.stdout
    if tear:
        assert f"skipping unreadable checkpoint {newest}" in rerun.stdout
        resumed = rerun.stdout.split("resumed from ", 1)[1].split()[0]
        assert os.path.basename(resumed) < os.path.basename(newest)
    expected, actual = final_model(reference), final_model(killed)
    assert expected.keys() == actual.keys()
    for key in expected:
        assert torch.equal(expected[key], actual[key]), f"{key} is not bitwise equal"
    assert (
        read_metrics(killed, "val")[-1]["top1"]
        == read_metrics(reference, "val")[-1]["top1"]
    )
