#!/usr/bin/env python3
"""Everything one GPU can check, in one command of about 5 minutes: the
``cuda`` tests, a short training run per path with its peak memory beside
the start-up report's, and resnet50's throughput beside a minimal loop.
Writes ``gpu_report.md`` and ``gpu_report.json`` to ``--out``.

    tools/gpu_check.sh --out "$OUT"   # on the GPU machine
    tools/gpu_check.sh --dry-run      # anywhere: list it all, run what needs no GPU

On the GPU machine (no registry; its python3 holds torch) the project and
the wheels of ``gpu_wheels/`` (``tools/gpu_wheels.py``) are first installed
into a folder of their own with ``pip install --no-index --no-deps
--target``, first on every later step's ``PYTHONPATH``.  Imports only the
standard library: it runs before the project is installed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import IO

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(REPO, "tools")
WHEEL_DIR = os.path.join(REPO, "gpu_wheels")
# What cuda_test_files looks for (tests/conftest.py holds every cuda test to it).
CUDA_MARK = "pytest.mark.cuda"
# Short runs of resnet18 on 64 px images, one epoch each.
SMALL = shlex.split(
    "MODEL.ARCH resnet18 MODEL.NUM_CLASSES 10 TRAIN.IM_SIZE 64 TEST.IM_SIZE 64 "
    "TRAIN.BATCH_SIZE 128 TEST.BATCH_SIZE 256 OPTIM.MAX_EPOCH 1 TRAIN.PRINT_FREQ 4 "
    "LOG.TRACKERS [] DEVICE cuda TRAIN.WORKERS 2"
)
SYNTHETIC = ["DATA.NAME", "synthetic", "DATA.SYNTHETIC_SIZE", "[2048,512]"]
BF16 = "TRAIN.MIXED_PRECISION bf16"
ZERO_2 = f"DIST.STRATEGY deepspeed DIST.DEEPSPEED.ZERO_STAGE 2 {BF16}"
EMA = "MODEL.EMA True MODEL.EMA_DECAY 0.99"
WORLD_1 = "world 1 joins no process group: the model is not {}"
# name: (launched by torchrun, KEY VALUE words, what it checks, a note)
RUNS = {
    "ddp": (True, "TRAIN.MIXED_PRECISION auto MODEL.CHANNELS_LAST True "
            "MODEL.COMPILE True",
            "ddp, torchrun, auto precision, channels-last, compile",
            WORLD_1.format("wrapped in DDP")),
    "fp16_ema": (False, f"TRAIN.MIXED_PRECISION fp16 {EMA}", "fp16, GradScaler, EMA",
                 ""),
    "fsdp_offload": (True, f"DIST.STRATEGY fsdp DIST.FSDP_CPU_OFFLOAD True "
                     f"OPTIM.CLIP_GRAD_NORM 1.0 {BF16}",
                     "fsdp, torchrun, CPU offload, clipping, bf16",
                     WORLD_1.format("sharded (tests/test_gpu_check.py shards it)")),
    "deepspeed": (False, ZERO_2, "DeepSpeed ZeRO-2, bf16", "a one-process NCCL group"),
    "deepspeed_ema": (False, f"{ZERO_2} {EMA}", "DeepSpeed ZeRO-2, bf16, EMA", ""),
    "dp": (False, f"DIST.STRATEGY dp {BF16}", "dp (DataParallel), bf16", ""),
    "gpu_decode": (False, "DATA.DECODER gpu MODEL.NUM_CLASSES 2",
                   "DATA.DECODER gpu on a JPEG folder",
                   "its pixels against the CPU decoder's: "
                   "tests/data/test_gpu_decode.py"),
}  # fmt: skip
# Seconds kept for the throughput measurement at the end.
BENCHMARK_S = 75.0
# What a step may end as in a check that passed.
GOOD = ("passed", "skipped", "would run")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line (``sys.argv[1:]`` when ``argv`` is None)."""
    parser = argparse.ArgumentParser(
        prog="gpu_check.sh",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--dry-run", action="store_true", help="run only what needs no GPU")
    add(
        "--out",
        default=os.path.join(REPO, "exp", "gpu_check"),
        help="folder of gpu_report.md and gpu_report.json",
    )
    add("--work", default="", help="folder of the runs (default: a temporary one)")
    add("--budget", type=float, default=300.0, help="seconds for all the steps")
    add("--parallel", type=int, default=3, help="GPU steps at a time")
    add("--validate-configs", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


@dataclasses.dataclass
class Step:
    """One thing the check does: a command, or ``action`` in this process."""

    name: str
    what: str
    command: list[str] = dataclasses.field(default_factory=list)
    needs_gpu: bool = True
    timeout: float = 150.0
    action: Callable[[], dict] | None = None
    out_dir: str = ""  # a training run's OUT_DIR
    note: str = ""


def run_options(name: str, work: str) -> list[str]:
    """Every KEY VALUE word of the run ``name``."""
    data = SYNTHETIC
    if name == "gpu_decode":
        jpegs = os.path.join(work, "jpegs")
        data = ["TRAIN.DATASET", jpegs, "TEST.DATASET", jpegs]
    out_dir = os.path.join(work, "runs", name)
    return [*SMALL, *data, *shlex.split(RUNS[name][1]), "OUT_DIR", out_dir]


def run_steps(python: str, work: str) -> list[Step]:
    """A short training run per path, each a train_net.py process."""
    steps = []
    for name, (torchrun, words, what, note) in RUNS.items():
        launch = [python]
        if torchrun:
            launch += ["-m", "torch.distributed.run", "--standalone"]
            launch += ["--nproc-per-node", "1"]
        options = run_options(name, work)
        command = [*launch, os.path.join(TOOLS, "train_net.py"), *options]
        timeout = 240.0 if "MODEL.COMPILE" in words else 150.0
        step = Step(name, what, command, timeout=timeout, note=note)
        step.out_dir = options[-1]
        steps.append(step)
    return steps


def validate_configs(work: str) -> int:
    """Load and validate every run's config, as train_net does (no GPU)."""
    from distribuuuu.config import load_cfg

    for name in RUNS:
        load_cfg(None, run_options(name, work))
    print(f"{len(RUNS)} configs valid")
    return 0


def write_jpegs(root: str, per_class: int = 96) -> dict:
    """Two classes of JPEGs of 96 to 160 px, in train/ and val/."""
    from PIL import Image

    rng = random.Random(0)
    for split, count in (("train", per_class), ("val", per_class // 4)):
        for label in range(2):
            folder = os.path.join(root, split, f"class{label}")
            os.makedirs(folder, exist_ok=True)
            for i in range(count):
                size = (rng.randint(96, 160), rng.randint(96, 160))
                colour = (120 * label + rng.randint(0, 100), rng.randint(0, 255), 90)
                noise = Image.effect_noise(size, 40).convert("RGB")
                image = Image.blend(noise, Image.new("RGB", size, colour), 0.6)
                image.save(os.path.join(folder, f"{i}.jpg"), quality=90)
    return {"images": 2 * (per_class + per_class // 4)}


ENVIRONMENT = """import json, platform, torch, torchvision
from importlib import metadata
def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
cuda = torch.cuda.is_available()
print(json.dumps({"python": platform.python_version(), "torch": torch.__version__,
    "torchvision": torchvision.__version__, "cuda": torch.version.cuda,
    "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
    **{name: version(name) for name in ("deepspeed", "timm", "numpy", "yacs")}}))
"""


def tool(python: str, name: str, words: str, *more: str) -> list[str]:
    """``python tools/NAME WORDS MORE``, WORDS split as a shell would."""
    return [python, os.path.join(TOOLS, name), *shlex.split(words), *more]


def cpu_steps(python: str, work: str, site: str, dry_run: bool) -> list[Step]:
    """The steps that need no GPU: pip installs gpu_wheels/ and the project
    into ``site`` from nothing else (a dry run installs nothing: the wheels
    step asks pip instead), then the wheels, versions, JPEGs and configs."""
    what = "pip install --no-index --no-deps gpu_wheels/ and the project"
    install = Step("install", what, needs_gpu=False)
    if dry_run:
        install.note = "a dry run: the installed project is used"
    else:
        install.command = tool(python, "gpu_wheels.py", "install", site)
    wheels = tool(python, "gpu_wheels.py", "check --json", f"{work}/wheels.json")
    configs = tool(python, "gpu_check.py", "--validate-configs --work", work)
    return [
        install,
        Step("wheels", "gpu_wheels/ covers setup.py's needs", wheels, False),
        Step("environment", "versions", [python, "-c", ENVIRONMENT], False),
        Step("jpegs", "a JPEG folder for DATA.DECODER gpu", needs_gpu=False,
             action=lambda: write_jpegs(os.path.join(work, "jpegs"))),
        Step("configs", "every run's config loads and validates", configs, False),
    ]  # fmt: skip


def cuda_test_files(tests_dir: str) -> list[str]:
    """The test modules that name the ``cuda`` marker (tests/conftest.py
    refuses a cuda test anywhere else): collecting every module would cost
    about 20 s of imports."""
    found = []
    for folder, _, names in os.walk(tests_dir):
        for name in names:
            if not (name.startswith("test_") and name.endswith(".py")):
                continue
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                if CUDA_MARK in f.read():
                    found.append(f.name)
    return sorted(found)


def gpu_steps(python: str, work: str, dry_run: bool) -> list[Step]:
    """The cuda tests, the runs and the benchmark, longest first; a dry run
    collects the cuda tests instead (that needs no GPU)."""
    pytest = [python, "-m", "pytest", "-m", "cuda", "-p", "no:cacheprovider"]
    files = cuda_test_files(os.path.join(REPO, "tests"))
    xml = f"--junitxml={work}/cuda_tests.xml"
    parallel = ["-q", "-n", "4", "--dist", "loadfile", xml, *files]
    tests = Step("cuda_tests", "pytest -m cuda", [*pytest, *parallel], timeout=240.0)
    collect = [*pytest, "--collect-only", "-q", *files]
    collected = Step("cuda_tests_collected", "the cuda tests", collect, False)
    measure = "--only train --model resnet50 --im-size 224 --batch 128 --precision "
    measure += "bf16 --channels-last --steps 20 --repeats 3 --out"
    benchmark = tool(python, "benchmark.py", measure, f"{work}/benchmark.json")
    what = "resnet50, 224 px, bf16, channels-last, synthetic: ours / minimal loop"
    throughput = Step("throughput", what, benchmark)
    runs = run_steps(python, work)
    return [*([collected] if dry_run else []), runs[0], tests, *runs[1:], throughput]


class LoggedProcess(subprocess.Popen):
    """A command step's process, with the temporary file of its output."""

    log: IO[str]


def start(step: Step, env: dict) -> LoggedProcess:
    """Start a command step in a session of its own; its output goes to a
    temporary file (a full pipe would stall it)."""
    # Closed by finish(), once the step has ended.
    log = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")  # noqa: SIM115
    proc = LoggedProcess(
        step.command,
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    proc.log = log
    return proc


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process it started, directly or not
    (torchrun starts its workers in sessions of their own)."""
    parents = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        path = f"/proc/{entry}/stat"
        with (
            contextlib.suppress(OSError, IndexError),
            open(path, encoding="utf-8") as f,
        ):
            parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
    doomed, todo = [], [pid]
    while todo:
        doomed.append(todo.pop())
        todo += [child for child, parent in parents.items() if parent == doomed[-1]]
    for target in doomed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(target, signal.SIGKILL)


def finish(proc: LoggedProcess, started: float, timed_out: bool) -> dict:
    """The result of a finished, or killed, command step."""
    proc.log.seek(0)
    lines = proc.log.read().strip().splitlines()
    proc.log.close()
    passed = proc.returncode == 0 and not timed_out
    return {
        "status": "timed out" if timed_out else "passed" if passed else "failed",
        "seconds": round(time.monotonic() - started, 1),
        "returncode": proc.returncode,
        "output": "\n".join(lines[-30:]),
    }


def run_inline(step: Step) -> dict:
    """An ``action`` step, run in this process, or a step with nothing to run."""
    if step.action is None:
        return {"status": "skipped", "note": step.note}
    started = time.monotonic()
    try:
        details = step.action()
    except Exception as error:  # reported; the other steps go on
        return {"status": "failed", "output": f"{type(error).__name__}: {error}"}
    seconds = round(time.monotonic() - started, 1)
    return {"status": "passed", "seconds": seconds, **details}


def run_all(steps: list[Step], env: dict, parallel: int, deadline: float) -> dict:
    """Run ``steps`` in order, ``parallel`` commands at a time, each within its
    timeout and the deadline; each step's result by name."""
    results, todo = {}, list(steps)
    running: dict[str, tuple[Step, LoggedProcess, float]] = {}
    while todo or running:
        while todo and len(running) < parallel:
            step = todo.pop(0)
            if time.monotonic() > deadline - 20:
                results[step.name] = {"status": "not run", "note": "out of time"}
            elif step.command:
                print(f"[gpu_check] {step.name}: started", flush=True)
                running[step.name] = (step, start(step, env), time.monotonic())
            else:
                results[step.name] = run_inline(step)
        time.sleep(0.2)
        for name, (step, proc, started) in list(running.items()):
            killed = proc.poll() is None
            if killed and time.monotonic() < min(started + step.timeout, deadline):
                continue
            if killed:
                kill_tree(proc.pid)
                proc.wait()
            results[name] = finish(proc, started, killed)
            print(f"[gpu_check] {name}: {results[name]['status']}", flush=True)
            del running[name]
    return results


def step_env(site: str, dry_run: bool) -> dict:
    """The environment of every command step.  On the GPU machine the
    installed folder comes first, and the working directory (the checkout)
    is kept off ``sys.path`` so that ``distribuuuu.tools`` is the installed
    package's."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if not dry_run:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [site, env.get("PYTHONPATH")]))
        env["PYTHONSAFEPATH"] = "1"
    return env


def check(args: argparse.Namespace, work: str) -> dict:
    """Run (or, in a dry run, list) every step; their results by name."""
    python, site = sys.executable, os.path.join(work, "site")
    cpu = cpu_steps(python, work, site, args.dry_run)
    gpu = gpu_steps(python, work, args.dry_run)
    for step in cpu + gpu:
        shown = step.command and "-c" not in step.command
        what = shlex.join(step.command) if shown else step.what
        would = args.dry_run and step.needs_gpu
        print(f"[gpu_check] {'would run' if would else 'step'} {step.name}: {what}")
    env, deadline = step_env(site, args.dry_run), time.monotonic() + args.budget
    results = run_all(cpu, env, 1, deadline)
    if args.dry_run:
        results.update(run_all([s for s in gpu if not s.needs_gpu], env, 1, deadline))
        results.update({s.name: {"status": "would run"} for s in gpu if s.needs_gpu})
    else:
        # The benchmark runs alone (a timing), in the last BENCHMARK_S.
        pool = deadline - BENCHMARK_S
        results.update(run_all(gpu[:-1], env, args.parallel, pool))
        results.update(run_all(gpu[-1:], env, 1, deadline))
    ordered = {}
    for step in cpu + gpu:  # in the order of the listing
        about = {"what": step.what, "note": step.note, "out_dir": step.out_dir}
        ordered[step.name] = {**about, **results[step.name]}
    return ordered


def main(argv: list[str] | None = None) -> int:
    """Run the check and its report; 0 when every step that ran passed."""
    args = parse_args(argv)
    if args.validate_configs:
        return validate_configs(args.work)
    work = args.work or tempfile.mkdtemp(prefix="gpu-check-")
    os.makedirs(work, exist_ok=True)
    try:
        steps = check(args, work)
        date = datetime.datetime.now(datetime.timezone.utc)
        mode = "dry run: nothing ran on a GPU" if args.dry_run else "on the GPU"
        with open(os.path.join(work, "steps.json"), "w", encoding="utf-8") as f:
            json.dump(
                {"date": f"{date:%Y-%m-%d %H:%M} UTC", "mode": mode, "steps": steps},
                f,
                indent=1,
            )
        report = [sys.executable, os.path.join(TOOLS, "gpu_report.py")]
        written = subprocess.run([*report, "--work", work, "--out", args.out])
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    bad = [name for name, result in steps.items() if result["status"] not in GOOD]
    return 1 if bad or written.returncode else 0


if __name__ == "__main__":
    sys.exit(main())
