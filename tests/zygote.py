"""``python SCRIPT ARGS`` in a process forked from one preloaded interpreter.

Most tests start the entry point as a user would, in a process of its own.
A new interpreter spends about 5 s of CPU importing torch and torchvision
before it reads its first argument, and the suite starts hundreds of them on
2 cores. So each pytest worker keeps one *zygote*: an interpreter that
imports them once (single-threaded: ``OMP_NUM_THREADS=1``, see conftest.py)
and then forks one child per command. The child takes a session, stdout,
stderr, working directory and environment of its own and runs the script
(or ``-m`` module) as ``__main__`` with ``runpy``, as the interpreter would;
the zygote reports its exit status, a signal's included.

What differs from a new interpreter: the modules are imported already (and
frozen out of the children's garbage collections), and the children share
one ``hash()`` seed. Tests of start-up itself (imports,
time) run a real interpreter (:func:`helpers.run_command`). A command whose
environment differs from the zygote's does too, since some variables are
read at import time: the zygote refuses it, and the client starts one.
(Variables the imports set themselves, such as the ``TORCHINDUCTOR_CACHE_DIR``
that importing ``torch._dynamo`` sets, may be missing from the command's.)

torchrun's workers come from the zygote too (:func:`worker`): torchrun
starts ``python -S zygote.py --worker ADDRESS SCRIPT ARGS`` for each
(``--no-python``), a client that asks the zygote to fork the worker with the
client's stdin, stdout, stderr, directory and environment, forwards the
signals torchrun sends it, and ends as the worker ended. Its environment may
differ from the zygote's in the variables torchrun sets too; where the
zygote refuses it, or is gone, the client becomes ``python -u SCRIPT ARGS``.
The tests start commands they signal or kill mid-run the same way
(helpers.python_command). While a worker lives, the zygote's folder holds
``PID.worker``, naming its client, so that the tests' walks of the process
tree (helpers.descendants) see the worker as the client's child.

The protocol, one connection per command: the client sends a byte, with its
descriptors 0, 1 and 2 for a worker, then a JSON line (``argv``, ``cwd``,
``env``; ``out``, ``err``: file paths for a command); the zygote answers the
child's pid (``new`` and the variables that differ, for a command it will
not fork), then its exit status, a line each. A child whose client hangs
up first is killed with its session.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import inspect
import io
import json
import os
import random
import runpy
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import traceback

# What a run imports, once: torch, torchvision, torchrun, the trainer and
# its default tracker (tensorboard's writer).
PRELOAD = (
    "torch",
    "torchvision",
    "torch.distributed.run",
    "torch.utils.tensorboard",
    "distribuuuu.cli",
    "distribuuuu.job",
    "distribuuuu.engine.trainer",
    "distribuuuu.strategies",
)
# Preloaded where installed, on a host without NVIDIA's driver (there its
# import would set up NVML and a CUDA accelerator for the children to
# inherit): DeepSpeed costs each of its ranks 4-5 s of imports, MLflow's and
# pyarrow's among them (pyarrow's jemalloc would start a thread of its own
# but for NO_THREADS).
OPTIONAL = () if os.path.exists("/dev/nvidiactl") else ("deepspeed",)
NO_THREADS = {"JE_ARROW_MALLOC_CONF": "background_thread:false"}


# What torchrun (and DeepSpeed's launcher: CROSS_, LOCAL_SIZE and the
# devices, read at CUDA's start) sets for its workers, read when a run
# starts, not at import.
LAUNCHER_SETS = frozenset(
    [
        "CROSS_RANK",
        "CROSS_SIZE",
        "LOCAL_SIZE",
        "CUDA_VISIBLE_DEVICES",
        "LOCAL_RANK",
        "RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_NAME",
        "LOCAL_WORLD_SIZE",
        "WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    ]
)
# Read when a run starts, never at import, and set in the pytest worker by
# what it ran in-process, so that they would otherwise send every later
# command to a new interpreter: pytest's; torchrun's (its TORCHELASTIC_ and
# NCCL ones); the engine's (CUBLAS_WORKSPACE_CONFIG for determinism,
# KINETO_LOG_LEVEL before the profiler starts); inductor's, compiling (a
# pointer its compiled code reads); importing DeepSpeed's
# (PYTORCH_NVML_BASED_CUDA_CHECK) and MLflow's (its telemetry session, and
# the HTTP retries reporting/remote_trackers.py bounds).  W&B's, which the
# tracker tests set: the zygote does not import W&B, its children do.  The
# terminal's COLUMNS, which the live bar reads as it draws.
IGNORED = (
    "PYTEST_CURRENT_TEST",
    "TORCHELASTIC_",
    "TORCH_NCCL_",
    "CUBLAS_WORKSPACE_CONFIG",
    "KINETO_LOG_LEVEL",
    "PYTORCH_NVML_BASED_CUDA_CHECK",
    "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",
    "_MLFLOW_TELEMETRY_SESSION_ID",
    "MLFLOW_HTTP_REQUEST_",
    "WANDB_",
    "COLUMNS",
)


def differ(env: dict, base: dict, made: set[str]) -> set[str]:
    """The variables set differently in ``env`` and in the zygote's ``base``
    that could matter at import time; ``made``: those its imports set."""
    names = {name for name, _ in set(env.items()) ^ set(base.items())}
    names -= made - env.keys()  # a new interpreter would set them alike
    return {name for name in names if not name.startswith(IGNORED)}


def _exit_code(code: object) -> int:
    """The status ``sys.exit(code)`` gives the interpreter."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _run(argv: list[str]) -> int:
    """``python ARGV`` in this process: its exit status."""
    try:
        if argv[0] == "-m":
            sys.argv, sys.path[0] = ["-m", *argv[2:]], os.getcwd()
            sys.modules.pop(argv[1], None)  # preloaded: run it afresh, quietly
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        return 0
    except SystemExit as stop:
        return _exit_code(stop.code)
    except BaseException:
        traceback.print_exc()
        return 1


def _unbuffered(stream: io.TextIOWrapper, fd: int) -> io.TextIOWrapper:
    """``stream`` as ``python -u`` makes it: every write reaches ``fd``."""
    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(
        raw,
        stream.encoding,
        stream.errors,
        write_through=True,  # type: ignore[arg-type]
    )


def _child(request: dict, fds: list[int]) -> None:
    """Become the command's process; never returns."""
    code = 1
    try:
        os.setsid()
        if fds:  # a worker: the client's stdin, stdout, stderr, unbuffered
            for fd, given in enumerate(fds):
                os.dup2(given, fd)
                os.close(given)
            sys.stdout = _unbuffered(sys.stdout, 1)
            sys.stderr = _unbuffered(sys.stderr, 2)
        else:
            for fd, path in ((1, request["out"]), (2, request["err"])):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        random.seed()  # as a new interpreter seeds it
        code = _run(request["argv"])
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
        os._exit(code)


def _accept(
    listener: socket.socket, base: dict, made: set[str]
) -> tuple[int, socket.socket]:
    """Take a command, fork its child: (the child's pid or 0, the connection)."""
    conn, _ = listener.accept()
    _, fds, _, _ = socket.recv_fds(conn, 1, 3)
    request = json.loads(conn.makefile().readline())
    unlike = differ(request["env"], base, made) - (LAUNCHER_SETS if fds else set())
    if unlike:  # a command this interpreter cannot stand for
        conn.sendall(f"new {' '.join(sorted(unlike))}\n".encode())
        pid = 0
    else:
        pid = os.fork()
        if pid == 0:
            listener.close()
            conn.close()
            _child(request, fds)
        if fds:  # the tests' process walks see the worker as its client's child
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
            record = _record(listener, pid)
            with open(f"{record}.tmp", "w", encoding="utf-8") as f:
                f.write(str(struct.unpack("3i", creds)[0]))
            os.replace(f"{record}.tmp", record)
        conn.sendall(f"{pid}\n".encode())
    for fd in fds:
        os.close(fd)
    return pid, conn


def _record(listener: socket.socket, pid: int) -> str:
    """The file that names the client of worker ``pid`` while it lives."""
    return os.path.join(os.path.dirname(listener.getsockname()), f"{pid}.worker")


def _kill_session(pid: int) -> None:
    """SIGKILL the child and the session it leads (once it has made it)."""
    for kill in (os.killpg, os.kill):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(pid, signal.SIGKILL)


def serve(address: str) -> None:
    """Preload, then fork a child per connection until the parent is gone."""
    launched = dict(os.environ)
    for name in PRELOAD:
        importlib.import_module(name)
    os.environ.update(NO_THREADS)
    for name in OPTIONAL:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    if len(os.listdir("/proc/self/task")) > 1:
        sys.exit("zygote: threads started at import; forking it is unsafe")
    # torchrun's rendezvous names its callers with inspect.stack(), which
    # maps each frame's file to its module: a file no module has (such as
    # "<frozen runpy>", hence frozen_modules=off) makes it read all of the
    # thousands loaded, and so does its first call. Filled here, that cache
    # saves each launch about 2 s.
    inspect.getmodule(compile("", "<fill>", "exec"))
    # What was imported lives as long as the children: their collections
    # need not walk it (nor touch its pages, shared until written).
    gc.collect()
    gc.freeze()
    parent, base = os.getppid(), dict(os.environ)
    made = base.keys() - launched.keys()
    children: dict[int, socket.socket | None] = {}  # pid: its client
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(16)
    atexit.register(shutil.rmtree, os.path.dirname(address), True)
    while os.getppid() == parent:
        clients = {conn: pid for pid, conn in children.items() if conn}
        for ready in select.select([listener, *clients], [], [], 0.05)[0]:
            if ready is listener:
                pid, conn = _accept(listener, base, made)
                if pid:
                    children[pid] = conn
                else:
                    conn.close()
            elif not ready.recv(1):  # the client hung up: its child goes too
                _kill_session(clients[ready])
                children[clients[ready]] = None
                ready.close()
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                with contextlib.suppress(OSError):
                    os.remove(_record(listener, pid))
                conn = children.pop(pid)
                if conn:
                    with contextlib.suppress(OSError):
                        conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                    conn.close()


class Zygote:
    """The client: this process's zygote, started at the first command and
    killed with this process."""

    def __init__(self, cwd: str, env: dict):
        self.cwd, self.env = cwd, dict(env)
        self.refused: list[str] = []  # the variables of its last refusal
        self.folder = tempfile.mkdtemp(prefix="zygote-")
        self.address = os.path.join(self.folder, "socket")
        # The standard library from its files: see serve() on inspect.
        source = ["-X", "frozen_modules=off"]
        self.proc = subprocess.Popen(
            [sys.executable, *source, os.path.abspath(__file__), self.address],
            cwd=cwd,
            env=self.env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        atexit.register(self.stop)

    def stop(self) -> None:
        """Kill it, and remove its folder."""
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)

    def ready(self, seconds: float = 300) -> bool:
        """Whether it listens (it imports for some seconds first)."""
        deadline = time.monotonic() + seconds
        while not os.path.exists(self.address):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def worker_command(self) -> list[str]:
        """What torchrun runs (``--no-python``) before ``SCRIPT ARGS`` to fork
        its workers here."""
        return [
            sys.executable,
            "-S",
            os.path.abspath(__file__),
            "--worker",
            self.address,
        ]

    def workers(self) -> dict[int, int]:
        """client pid: worker pid, for each worker (:func:`worker`) that lives."""
        found = {}
        for name in os.listdir(self.folder):
            pid, _, kind = name.partition(".")
            with contextlib.suppress(OSError, ValueError):
                if kind == "worker":
                    with open(os.path.join(self.folder, name), encoding="utf-8") as f:
                        found[int(f.read())] = int(pid)
        return found

    def run(self, argv: list[str], timeout: float, env: dict, kill_tree):
        """``python ARGV``: (exit status or None on time-out, stdout, stderr),
        or None where the zygote will not run it (its environment).

        On time-out ``kill_tree(pid)`` stops the command and all it started.
        """
        if not self.ready():
            return None
        out, err = (os.path.join(self.folder, f"{n}.{time.time_ns()}") for n in "oe")
        for path in (out, err):
            open(path, "w").close()
        request = dict(argv=argv, cwd=self.cwd, env=env, out=out, err=err)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(self.address)
            sock.sendall(b"c")
            sock.sendall((json.dumps(request) + "\n").encode())
            answers = sock.makefile()
            answer = answers.readline().strip()
            if not answer.isdigit():
                self.refused = answer.split()[1:]
                return None
            pid = int(answer)
            sock.settimeout(timeout)
            code = None
            try:
                code = int(answers.readline())
            except TimeoutError:
                kill_tree(pid)
            finally:  # what the command left in its session
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
        texts = []
        for path in (out, err):
            with open(path, encoding="utf-8", errors="replace") as f:
                texts.append(f.read())
            os.remove(path)
        return code, texts[0], texts[1]


def worker(address: str, argv: list[str]) -> None:
    """torchrun's worker ``python -u ARGV``, forked from the zygote at
    ``address``: this client passes the signals it gets on to the worker's
    session, and ends as the worker ended."""
    request = dict(argv=argv, cwd=os.getcwd(), env=dict(os.environ))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(address)
        socket.send_fds(sock, [b"w"], [0, 1, 2])
        sock.sendall((json.dumps(request) + "\n").encode())
        answers = sock.makefile()
        pid = answers.readline().strip()
    except OSError:  # the zygote is gone
        pid = ""
    if not pid.isdigit():
        os.execv(sys.executable, [sys.executable, "-u", *argv])

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(int(pid), signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(signum, forward)
    answer = answers.readline().strip()
    code = int(answer) if answer else 1  # no answer: the zygote is gone
    if code < 0:  # killed by a signal: so is this process
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    if sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3:])
    else:
        serve(sys.argv[1])
