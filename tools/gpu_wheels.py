#!/usr/bin/env python3
"""The wheels that travel to the GPU machine: what the project needs there
beyond what that machine has, in ``gpu_wheels/`` (ignored by git).

    python tools/gpu_wheels.py fetch    # here (a registry): gpu_check.sh --fetch-wheels
    python tools/gpu_wheels.py check [--json FILE]
    python tools/gpu_wheels.py install TARGET   # on the GPU machine (gpu_check.sh)

The GPU machine has no registry.  Its python3 (3.12) holds torch, torchvision
and what :data:`GPU_MACHINE_HAS` names; the rest is :data:`WHEELS`, installed
there with the project by ``install``: ``pip install --no-index --no-deps
--target``.
``check`` tells whether :data:`WHEELS` cover the project's requirements as
pip installed them from ``setup.py`` (and the :data:`EXTRAS` the GPU check
uses), and where ``gpu_wheels/`` exists, that it holds exactly those wheels,
that their own requirements are covered, that pip takes them for CPython
3.12 on manylinux x86-64, and its size.  Only the standard library and
``packaging`` (which pip and pytest bring) are imported.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from email.parser import HeaderParser

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHEEL_DIR = os.path.join(REPO, "gpu_wheels")
# The device tool carries at most 64 MiB with the working tree.
WHEEL_BUDGET_MB = 40
# What gpu_wheels/ holds, one version of each (two stop pip's install): the
# project's requirements, and theirs, that the GPU machine lacks or may hold
# too old (pydantic asks for typing-extensions>=4.16).  The versions are those
# the main venv runs.  DeepSpeed ships only a source archive: its wheel is
# built here (BUILT_HERE), the others are downloaded for the GPU machine.
WHEELS = (
    "yacs==0.1.8",
    "mlxtend==0.25.0",
    "turbojpeg==0.0.2",
    "deepspeed==0.19.8",
    "hjson==3.1.0",
    "pydantic==2.14.4",
    "pydantic-core==2.50.5",
    "annotated-types==0.8.0",
    "typing-inspection==0.4.5",
    "typing-extensions==4.16.0",
)
BUILT_HERE = ("deepspeed",)
# The GPU machine's packages that the project and the wheels above ask for
# (from the list of its image; versions unread, torch 2.11 and torchvision 0.26
# seen).  mlxtend's own needs are among them, though it is never imported.
GPU_MACHINE_HAS = frozenset({
    "torch", "torchvision", "numpy", "pyyaml", "pillow", "tensorboard", "timm",
    "onnx", "onnxscript", "onnxruntime", "einops", "msgpack", "ninja",
    "packaging", "psutil", "py-cpuinfo", "tqdm", "nvidia-ml-py", "scipy",
    "pandas", "scikit-learn", "matplotlib", "joblib", "pytest", "pytest-xdist",
    "setuptools", "wheel", "typing-extensions",
})  # fmt: skip
# The project's extras that the GPU check uses beyond install_requires.
EXTRAS = ("deepspeed", "timm", "onnx")
# The GPU machine's Python, for the requirements' markers and the wheels' tags.
TARGET_ENV = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "sys_platform": "linux",
    "os_name": "posix",
    "implementation_name": "cpython",
}
TARGET_TAGS = ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312"]
for _glibc in ("manylinux_2_28", "manylinux_2_17", "manylinux2014", "manylinux1"):
    TARGET_TAGS += ["--platform", f"{_glibc}_x86_64"]
TARGET_TAGS += ["--only-binary=:all:"]


def pinned() -> dict[str, str]:
    """``{canonical name: version}`` of :data:`WHEELS`."""
    pairs = (text.split("==") for text in WHEELS)
    return {canonicalize_name(name): version for name, version in pairs}


def uncovered(requirements: list[str], carried: dict[str, str], extras) -> list:
    """The requirements (texts) that apply on the GPU machine with ``extras``
    and that neither a carried version nor the machine satisfies (a carried
    version replaces the machine's)."""
    missing = []
    for text in requirements:
        requirement = Requirement(text)
        marker = requirement.marker
        environments = [{**TARGET_ENV, "extra": extra} for extra in ("", *extras)]
        if marker and not any(marker.evaluate(env) for env in environments):
            continue
        name = canonicalize_name(requirement.name)
        if name in carried:
            if not requirement.specifier.contains(carried[name], prereleases=True):
                missing.append(f"{text} (carried: {carried[name]})")
        elif name not in GPU_MACHINE_HAS:
            missing.append(text)
    return missing


def wheel_metadata(path: str) -> tuple[str, str, list[str]]:
    """(canonical name, version, Requires-Dist lines) of a wheel file."""
    with zipfile.ZipFile(path) as wheel:
        name = next(
            entry
            for entry in wheel.namelist()
            if entry.endswith(".dist-info/METADATA") and entry.count("/") == 1
        )
        headers = HeaderParser().parsestr(wheel.read(name).decode("utf-8"))
    requires = headers.get_all("Requires-Dist") or []
    return canonicalize_name(headers["Name"]), headers["Version"], requires


def project_requirements() -> list[str]:
    """The project's requirements as pip installed them (from setup.py)."""
    from importlib import metadata

    return metadata.requires("distribuuuu") or []


def pip_refuses(paths: list[str]) -> str:
    """pip's complaint ('' if none) about installing ``paths`` on the GPU
    machine's Python (a dry run into a temporary folder)."""
    pip = [sys.executable, "-m", "pip", "install", "--dry-run", "-q", "--no-index"]
    with tempfile.TemporaryDirectory() as target:
        pip += ["--no-deps", "--target", target, *TARGET_TAGS, *paths]
        done = subprocess.run(pip, capture_output=True, text=True)
    if done.returncode == 0:
        return ""
    return done.stderr.strip()[-800:] or f"pip exited {done.returncode}"


def check_folder(folder: str, carried: dict[str, str]) -> tuple[dict, list[str]]:
    """The wheels of ``folder``, their total size, and what is wrong with them:
    another set than ``carried``, a need not covered, a tag pip refuses for
    the GPU machine, or a size over :data:`WHEEL_BUDGET_MB`."""
    files = sorted(f for f in os.listdir(folder) if f.endswith(".whl"))
    paths = [os.path.join(folder, f) for f in files]
    found, problems = {}, []
    for file, path in zip(files, paths):
        name, version, requires = wheel_metadata(path)
        if name in found:
            problems.append(f"two versions of {name} in {folder}")
        found[name] = version
        needs = uncovered(requires, carried, ())
        problems += [f"{file} needs {text}, not covered" for text in needs]
    if found != carried:
        problems.append(f"{folder} holds {found}, WHEELS pins {carried}")
    size = sum(os.path.getsize(path) for path in paths)
    if size > WHEEL_BUDGET_MB * 2**20:
        problems.append(f"{folder}: {size / 2**20:.1f} MiB, over {WHEEL_BUDGET_MB}")
    refused = pip_refuses(paths)
    if refused:
        problems.append(f"pip refuses them for CPython 3.12: {refused}")
    return {"files": files, "size_mb": round(size / 2**20, 2)}, problems


def check_wheels(folder: str = WHEEL_DIR) -> dict:
    """Whether :data:`WHEELS` cover the project's requirements beyond
    :data:`GPU_MACHINE_HAS`, and ``folder`` holds them (where it exists).
    ``problems`` lists what is wrong; empty when all is well."""
    carried = pinned()
    needs = uncovered(project_requirements(), carried, EXTRAS)
    problems = [f"not covered: {text}" for text in needs]
    result = {"declared": list(WHEELS), "files": None, "size_mb": None}
    if os.path.isdir(folder):
        found, more = check_folder(folder, carried)
        result.update(found)
        problems += more
    result["problems"] = problems
    return result


def fetch_wheels(folder: str = WHEEL_DIR) -> int:
    """Download the wheels for CPython 3.12 on manylinux x86-64 and build
    DeepSpeed's from its source archive into ``folder``, replacing it."""
    pip = [sys.executable, "-m", "pip"]
    built = [text for text in WHEELS if text.split("==")[0] in BUILT_HERE]
    downloaded = [text for text in WHEELS if text not in built]
    staging = tempfile.mkdtemp(prefix=".gpu-wheels-", dir=REPO)
    try:
        download = [*pip, "download", "--no-deps", *TARGET_TAGS, "-d", staging]
        subprocess.run([*download, *downloaded], check=True)
        # No torch in the build environment: DeepSpeed builds its ops just in
        # time, on the machine that runs them.
        env = {**os.environ, "DS_BUILD_OPS": "0"}
        build = [*pip, "wheel", "--no-deps", "-w", staging, *built]
        subprocess.run(build, check=True, env=env)
        os.chmod(staging, 0o755)  # mkdtemp made it private
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return report(check_wheels(folder))


def install(target: str, folder: str = WHEEL_DIR) -> int:
    """Install the wheels of ``folder``, then the project, into ``target``
    with pip and from nothing else (the GPU machine has no registry)."""
    if not os.path.isdir(folder):
        print(
            f"error: no {folder}: build it with tools/gpu_check.sh "
            "--fetch-wheels where a registry is, and carry it",
            file=sys.stderr,
        )
        return 1
    files = sorted(f for f in os.listdir(folder) if f.endswith(".whl"))
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
    pip += ["--no-cache-dir", "--no-compile", "--target", target]
    done = subprocess.run([*pip, *(os.path.join(folder, f) for f in files)])
    if done.returncode == 0:  # the GPU machine's setuptools builds the project
        done = subprocess.run([*pip, "--no-build-isolation", REPO])
    if done.returncode:
        return done.returncode
    print(f"installed {len(files)} wheels and the project into {target}")
    return 0


def report(result: dict) -> int:
    """Print ``result`` of :func:`check_wheels`; 1 if it found problems."""
    if result["files"] is None:
        print(f"{len(WHEELS)} wheels declared; {WHEEL_DIR} not built here")
    else:
        print(f"{len(result['files'])} wheels, {result['size_mb']} MiB:")
        print("\n".join(f"  {file}" for file in result["files"]))
    print("\n".join(result["problems"]) or "they cover the project's requirements")
    return 1 if result["problems"] else 0


def main(argv: list[str] | None = None) -> int:
    """``fetch``, ``check`` or ``install`` (see above); the exit code."""
    parser = argparse.ArgumentParser(
        prog="gpu_wheels.py",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    parser.add_argument("what", choices=["fetch", "check", "install"])
    parser.add_argument("target", nargs="?", default="", help="install: where to")
    parser.add_argument("--json", default="", help="check: also write it here")
    args = parser.parse_args(argv)
    if args.what == "fetch":
        return fetch_wheels()
    if args.what == "install":
        return install(args.target)
    result = check_wheels()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return report(result)


if __name__ == "__main__":
    sys.exit(main())
