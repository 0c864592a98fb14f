"""tools/gpu_check.sh, the prepared check of one GPU, and the wheels it carries
(tools/gpu_wheels.py): its dry run on the CPU, what it reads from the runs,
and the one-GPU part that a world-1 training run cannot reach (``cuda``)."""

from __future__ import annotations

import json
import os
import re
import sys
import zipfile

import pytest
import torch
import torch.distributed as dist
from helpers import (
    REPO,
    TINY,
    assert_ok,
    import_tool,
    read_text,
    run_command,
    train_net,
)

from distribuuuu.dist.group import release_groups
from distribuuuu.engine import numerics
from distribuuuu.models import build_model
from distribuuuu.strategies.fsdp import shard_fully
from distribuuuu.strategies.gradients import clip_gradients

gpu_check = import_tool("gpu_check")
gpu_report = import_tool("gpu_report")
gpu_wheels = import_tool("gpu_wheels")


def test_the_declared_wheels_cover_the_project_beyond_the_gpu_machine(tmp_path):
    """setup.py's requirements (as pip installed them) and the extras the
    check uses are on the GPU machine or among the carried wheels."""
    result = gpu_wheels.check_wheels(str(tmp_path / "not-built"))
    assert result["problems"] == []
    assert result["files"] is None  # no folder: only the declaration is checked


def test_uncovered_reads_markers_extras_and_carried_versions():
    carried = {"yacs": "0.1.8", "pydantic": "2.14.4"}
    requirements = [
        "torch>=2.11",  # on the machine
        "yacs>=0.1.8",
        "pydantic>=3; extra == 'deepspeed'",  # carried too old
        "wandb; extra == 'wandb'",  # an extra the check does not use
        "pywin32; platform_system == 'Windows'",  # not on the GPU machine
        "hjson; extra == 'deepspeed'",  # missing
    ]
    missing = gpu_wheels.uncovered(requirements, carried, ("deepspeed",))
    assert missing == ["pydantic>=3; extra == 'deepspeed' (carried: 2.14.4)",
                       "hjson; extra == 'deepspeed'"]  # fmt: skip


def _wheel(folder, name: str, version: str, *requires: str) -> None:
    path = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    lines = [f"Name: {name}", f"Version: {version}"]
    lines += [f"Requires-Dist: {text}" for text in requires]
    with zipfile.ZipFile(path, "w") as wheel:
        metadata = f"{name.replace('-', '_')}-{version}.dist-info/METADATA"
        wheel.writestr(metadata, "Metadata-Version: 2.1\n" + "\n".join(lines) + "\n")


def test_a_built_folder_is_checked_against_the_declaration(tmp_path, monkeypatch):
    """Exactly the declared wheels, their own needs covered, pip's verdict."""
    monkeypatch.setattr(gpu_wheels, "pip_refuses", lambda paths: "")
    for text in gpu_wheels.WHEELS:
        _wheel(tmp_path, *text.split("=="))
    assert gpu_wheels.check_wheels(str(tmp_path))["problems"] == []
    _wheel(tmp_path, "yacs", "0.1.7")  # a second version
    _wheel(tmp_path, "extra-thing", "1.0", "not-on-the-machine>=1")
    problems = gpu_wheels.check_wheels(str(tmp_path))["problems"]
    assert any("two versions of yacs" in p for p in problems), problems
    assert any("needs not-on-the-machine>=1" in p for p in problems), problems
    assert any("WHEELS pins" in p for p in problems), problems


def test_the_report_shows_steps_memory_tests_and_failures():
    steps = {
        "environment": {"what": "versions", "status": "passed", "torch": "2.11.0",
                        "torchvision": "0.26.0", "cuda": "13.0", "nccl": "2.27.7",
                        "python": "3.12.3", "deepspeed": "0.19.8",
                        "gpus": ["NVIDIA H100 80GB HBM3"]},
        "fp16_ema": {"what": "fp16", "status": "passed", "seconds": 20.5,
                     "peak_mib": 900.0, "train_peak_mib": 850.0,
                     "predicted_mib": 180.4},
        "cuda_tests": {"what": "pytest -m cuda", "status": "failed", "passed": 3,
                       "skipped": 2, "failed_tests": ["test_x::test_y"],
                       "output": "E   AssertionError: pixels differ"},
        "throughput": {"what": "resnet50", "status": "passed", "ours": 2900.1,
                       "minimal": 3000.2, "ratio": 0.967},
    }  # fmt: skip
    text = gpu_report.format_report({"date": "d", "mode": "on the GPU", "steps": steps})
    assert "NVIDIA H100 80GB HBM3; torch 2.11.0 (CUDA 13.0" in text
    assert "| fp16_ema | passed | 20.5 | 900.0 (850.0) | 180.4 | fp16 |" in text
    assert "cuda tests: 3 passed, 1 failed, 2 skipped" in text
    assert "- failed: test_x::test_y" in text
    assert "ratio 0.967" in text
    assert "## cuda_tests: failed" in text and "pixels differ" in text
    assert "pipeline and tensor parallelism need two GPUs" in text


def test_junit_counts(tmp_path):
    xml = tmp_path / "t.xml"
    xml.write_text(
        '<testsuites><testsuite tests="4"><testcase classname="a" name="ok"/>'
        '<testcase classname="a" name="bad"><failure message="x"/></testcase>'
        '<testcase classname="b" name="err"><error message="y"/></testcase>'
        '<testcase classname="b" name="gpus"><skipped message="2 GPUs"/>'
        "</testcase></testsuite></testsuites>"
    )
    found = gpu_report.junit_details(str(xml))
    assert found == {"passed": 1, "failed_tests": ["a::bad", "b::err"], "skipped": 1}


@pytest.mark.slow
def test_steps_run_in_parallel_within_their_time(tmp_path):
    """Commands run ``parallel`` at a time; one past its timeout is killed,
    one that cannot start before the deadline is not run."""
    step = gpu_check.Step
    steps = [
        step("ok", "true", ["sh", "-c", "echo fine"]),
        step("bad", "exit 3", ["sh", "-c", "echo broken; exit 3"]),
        step("slow", "sleep", ["sh", "-c", "sleep 30"], timeout=1.0),
        step("inline", "action", action=lambda: {"images": 4}),
    ]
    results = gpu_check.run_all(steps, dict(os.environ), 2, deadline=1e12)
    assert results["ok"]["status"] == "passed" and results["ok"]["output"] == "fine"
    assert results["bad"]["status"] == "failed" and results["bad"]["returncode"] == 3
    assert results["slow"]["status"] == "timed out"
    assert results["slow"]["seconds"] < 10
    assert results["inline"]["status"] == "passed" and results["inline"]["images"] == 4
    late = gpu_check.run_all(steps[:1], dict(os.environ), 1, deadline=0.0)
    assert late["ok"]["status"] == "not run"


@pytest.mark.slow
def test_run_details_read_a_real_run(tmp_path):
    """Peak memory, the start-up report's figure and top-1, as a run writes
    them (on the CPU the peak is the resident set)."""
    out = str(tmp_path / "run")
    assert_ok(train_net(*TINY, "OUT_DIR", out))
    details = gpu_report.run_details(out)
    assert details["predicted_mib"] > 0 and details["peak_mib"] > 0
    assert details["train_peak_mib"] <= details["peak_mib"]
    assert 0 <= details["top1"] <= 100


def test_the_cuda_tests_are_looked_for_in_the_modules_that_mark_them(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "test_gpu.py").write_text("@pytest.mark.cuda\ndef test_a(): 0")
    (tmp_path / "test_cpu.py").write_text("def test_b(): pass\n")
    (tmp_path / "helpers.py").write_text("pytest.mark.cuda\n")
    found = gpu_check.cuda_test_files(str(tmp_path))
    assert found == [str(tmp_path / "sub" / "test_gpu.py")]
    ours = gpu_check.cuda_test_files(os.path.join(REPO, "tests"))
    assert os.path.join(REPO, "tests", "test_gpu_path.py") in ours
    assert os.path.join(REPO, "tests", "test_layout.py") not in ours


@pytest.mark.slow
def test_dry_run_lists_every_step_and_runs_those_without_a_gpu(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    cmd = [os.path.join(REPO, "tools", "gpu_check.sh"), "--dry-run"]
    cmd += ["--out", str(out), "--work", str(work)]
    result = run_command(cmd, timeout=300, env={"PYTHON": sys.executable})
    assert_ok(result)
    for name in [*gpu_check.RUNS, "cuda_tests", "throughput"]:
        assert f"would run {name}: " in result.stdout
    steps = json.loads((out / "gpu_report.json").read_text())["steps"]
    assert steps["wheels"]["status"] == "passed", steps["wheels"]
    assert steps["configs"]["status"] == "passed", steps["configs"]
    assert steps["environment"]["torch"] == torch.__version__
    assert steps["jpegs"]["images"] == len(list(work.glob("jpegs/*/*/*.jpg")))
    collected = steps["cuda_tests_collected"]
    assert collected["status"] == "passed", collected
    assert {steps[name]["status"] for name in gpu_check.RUNS} == {"would run"}
    assert "dry run: nothing ran on a GPU" in (out / "gpu_report.md").read_text()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fsdp_cpu_offload_with_clipping_in_a_one_gpu_group():
    """FSDP2 with CPU offload, bf16 and gradient clipping in a one-process
    NCCL group (a world-1 training run joins none, so shards nothing): the
    shards stay in host memory, the buffers on the GPU, and the finiteness
    check reduces per device."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    store = dist.HashStore()
    dist.init_process_group("cuda:nccl,cpu:gloo", store=store, rank=0, world_size=1)
    try:
        model = shard_fully(build_model("resnet8", 10), device, True, torch.bfloat16)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        images, targets = torch.randn(16, 3, 32, 32), torch.randint(10, (16,))
        for _ in range(3):
            loss = torch.nn.functional.cross_entropy(
                model(images.to(device)), targets.to(device)
            )
            optimizer.zero_grad()
            loss.backward()
            clip_gradients(list(model.parameters()), 1.0)
            optimizer.step()
        tensors = numerics.module_tensors(model)
        assert numerics.all_finite(tensors)
        devices = {p.to_local().device.type for p in model.parameters()}
        assert devices == {"cpu"}
        assert {b.device.type for b in model.buffers()} == {"cuda"}
    finally:
        dist.destroy_process_group()
        release_groups()


def test_ci_proves_the_floor_that_setup_py_declares():
    """.ci/run's second venv holds the oldest torch and torchvision that
    setup.py admits: the floor is a pair CI runs."""
    ci = read_text(REPO, ".ci", "run")
    pair = re.search(r"oldest=\(torch==(\S+) torchvision==(\S+)\)", ci)
    setup = read_text(REPO, "setup.py")
    floors = [
        re.search(rf'"{name}>=(\S+)"', setup) for name in ("torch", "torchvision")
    ]
    assert pair and all(floors), "no pair in .ci/run or no floor in setup.py"
    assert [floor.group(1) for floor in floors] == [pair.group(1), pair.group(2)]
