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

What differs from a new interpreter: the modules are imported already, and
the children share one ``hash()`` seed. Tests of start-up itself (imports,
time) run a real interpreter (:func:`helpers.run_command`). A command whose
environment differs from the zygote's does too, since some variables are
read at import time.

The protocol, one connection per command: the client sends a JSON line
(``argv``, ``cwd``, ``env``, ``out``, ``err``: file paths); the zygote
answers the child's pid, then its exit status, a line each.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import random
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback

# What a run imports, once: torch, torchvision, torchrun, the trainer.
PRELOAD = (
    "torch",
    "torchvision",
    "torch.distributed.run",
    "distribuuuu.cli",
    "distribuuuu.job",
    "distribuuuu.engine.trainer",
    "distribuuuu.strategies",
)


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


def _child(request: dict) -> None:
    """Become the command's process; never returns."""
    code = 1
    try:
        os.setsid()
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


def serve(address: str) -> None:
    """Preload, then fork a child per connection until the parent is gone."""
    for name in PRELOAD:
        importlib.import_module(name)
    if len(os.listdir("/proc/self/task")) > 1:
        sys.exit("zygote: threads started at import; forking it is unsafe")
    parent, children = os.getppid(), {}
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(16)
    atexit.register(shutil.rmtree, os.path.dirname(address), True)
    while os.getppid() == parent:
        if select.select([listener], [], [], 0.05)[0]:
            conn, _ = listener.accept()
            request = json.loads(conn.makefile().readline())
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                _child(request)
            conn.sendall(f"{pid}\n".encode())
            children[pid] = conn
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                conn = children.pop(pid)
                code = os.waitstatus_to_exitcode(status)
                with contextlib.suppress(OSError):
                    conn.sendall(f"{code}\n".encode())
                conn.close()


class Zygote:
    """The client: this process's zygote, started at the first command and
    killed with this process."""

    def __init__(self, cwd: str, env: dict):
        self.cwd, self.env = cwd, dict(env)
        self.folder = tempfile.mkdtemp(prefix="zygote-")
        self.address = os.path.join(self.folder, "socket")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), self.address],
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

    def takes(self, env: dict) -> bool:
        """Whether a command with this environment can run here."""
        ignored = {"PYTEST_CURRENT_TEST"}
        differ = set(env.items()) ^ set(self.env.items())
        return not {key for key, _ in differ} - ignored and self.ready()

    def run(self, argv: list[str], timeout: float, env: dict, kill_tree):
        """``python ARGV``: (exit status or None on time-out, stdout, stderr).

        On time-out ``kill_tree(pid)`` stops the command and all it started.
        """
        out, err = (os.path.join(self.folder, f"{n}.{time.time_ns()}") for n in "oe")
        for path in (out, err):
            open(path, "w").close()
        request = dict(argv=argv, cwd=self.cwd, env=env, out=out, err=err)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(self.address)
            sock.sendall((json.dumps(request) + "\n").encode())
            answers = sock.makefile()
            pid = int(answers.readline())
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


if __name__ == "__main__":
    serve(sys.argv[1])
