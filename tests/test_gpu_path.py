"""The CUDA path's logic, proven on the CPU (issue 16).

Where a fault shows only on GPUs (autocast per thread, backends, device
counts, per-device RNG state, cuDNN flags, the gloo side group), the logic is
separated from the device and run here with a fake of what torch.cuda would
answer, or on CPU threads and real gloo ranks.  Tests that need CUDA skip
without it.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.distributed as dist
from helpers import (
    TINY,
    assert_ok,
    call_main,
    free_port,
    read_metrics,
    run_launched,
    run_on_ranks,
    strategy_for,
    torchrun,
)
from helpers import train_net as train_net_command
from torch import nn

from distribuuuu import checkpoint as cp
from distribuuuu.checkpoint import format as run_state
from distribuuuu.config import get_cfg
from distribuuuu.dist import collectives
from distribuuuu.dist import group as du
from distribuuuu.engine import session
from distribuuuu.errors import DistributedSetupError, LaunchError
from distribuuuu.strategies import precision
from distribuuuu.strategies.dp import AutocastDataParallel

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 or more CUDA devices"
)


# --- DIST.MODE dp under bf16: each replica thread computes in bf16 ----------


class _DtypeProbe(nn.Module):
    """Records the autocast dtype a matmul gets, in whatever thread runs it."""

    def __init__(self, device_type: str):
        super().__init__()
        self.device_type, self.seen = device_type, []

    def forward(self, x):
        self.seen.append((x @ x.T).dtype)
        return x


def _in_worker_thread(replica, device_type: str, x) -> None:
    """Call ``replica`` as torch.nn.parallel.parallel_apply's worker does: in a
    new thread that enters autocast with the caller's enabled flag only."""
    enabled = torch.is_autocast_enabled(device_type)

    def worker():
        with torch.autocast(device_type, enabled=enabled):
            replica(x)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()


def test_a_new_thread_forgets_the_autocast_dtype():
    """The fault itself, on CPU threads: the dtype is per thread (CPU's
    default is bf16, so the caller asks for fp16 here; on CUDA it is the
    other way round, pytorch#125186)."""
    probe, x = _DtypeProbe("cpu"), torch.randn(4, 4)
    with torch.autocast("cpu", dtype=torch.float16):
        _in_worker_thread(probe, "cpu", x)
    assert probe.seen == [torch.bfloat16]


def test_dp_replicas_compute_in_the_callers_dtype_in_their_threads(monkeypatch):
    probe, x = _DtypeProbe("cpu"), torch.randn(4, 4)

    def parallel_apply_in_threads(self, replicas, inputs, kwargs):
        for replica, args in zip(replicas, inputs):
            _in_worker_thread(replica, "cpu", *args)
        return list(inputs)

    # DataParallel's own parallel_apply needs CUDA: run its worker's steps on
    # CPU threads instead, under the subclass's parallel_apply.
    monkeypatch.setattr(nn.DataParallel, "parallel_apply", parallel_apply_in_threads)
    wrapper = AutocastDataParallel(nn.Identity())
    wrapper.src_device_obj = torch.device("cpu")
    with torch.autocast("cpu", dtype=torch.float16):
        wrapper.parallel_apply([probe, probe], [(x,), (x,)], [{}, {}])
    assert probe.seen == [torch.float16, torch.float16]
    with torch.autocast("cpu", enabled=False):  # autocast off stays off
        wrapper.parallel_apply([probe], [(x,)], [{}])
    assert probe.seen[-1] == torch.float32


@pytest.mark.cuda
@needs_two_gpus
def test_dp_replicas_compute_in_bf16_on_gpus():
    device = torch.device("cuda", 0)
    probe = _DtypeProbe("cuda")
    model = strategy_for("dp", device=device).prepare_model(probe)
    assert isinstance(model, AutocastDataParallel)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(torch.randn(8, 8, device=device))
    assert probe.seen and set(probe.seen) == {torch.bfloat16}


# --- FSDP CPU offload on NCCL: gloo beside NCCL for host tensors -------------


@pytest.mark.parametrize(
    "requested, device, cpu_collectives, expected",
    [
        ("", "cuda", False, "nccl"),
        ("", "cuda", True, "cuda:nccl,cpu:gloo"),
        ("nccl", "cuda", True, "cuda:nccl,cpu:gloo"),
        ("gloo", "cuda", True, "gloo"),  # gloo reduces CPU tensors already
        ("", "cpu", False, "gloo"),
        ("", "cpu", True, "gloo"),
    ],
)
def test_backend_string(requested, device, cpu_collectives, expected):
    assert du.backend_for(requested, device, cpu_collectives) == expected


def _fake_setup(calls: list, device: torch.device):
    def setup_distributed(*args, **kwargs):
        calls.append(kwargs)
        return du.LaunchInfo("none", 0, 1, 0, 1, "127.0.0.1", 0), device

    return setup_distributed


@pytest.mark.parametrize(
    "strategy, offload, expected",
    [("fsdp", True, True), ("fsdp", False, False), ("ddp", True, False)],
)
def test_fsdp_offload_asks_for_cpu_collectives(
    monkeypatch, strategy, offload, expected
):
    calls: list = []
    monkeypatch.setattr(
        du, "setup_distributed", _fake_setup(calls, torch.device("cpu"))
    )
    cfg = get_cfg()
    cfg.DIST.STRATEGY, cfg.DIST.FSDP_CPU_OFFLOAD = strategy, offload
    with session.run_context(cfg, log_files=False):
        pass
    assert calls[0].get("cpu_collectives", False) is expected


# --- Resume with another number of visible GPUs -----------------------------


class _FakeCudaRng:
    """torch.cuda's RNG functions for ``count`` visible GPUs; a state is a
    tensor filled with its device's index and a serial number."""

    def __init__(self, monkeypatch, count: int):
        self.count, self.set_calls = count, []
        for module in (torch.cuda, torch.cuda.random):
            monkeypatch.setattr(module, "get_rng_state", self.get_rng_state)
            monkeypatch.setattr(module, "set_rng_state", self.set_rng_state)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.count)

    def _index(self, device) -> int:
        index = device.index if isinstance(device, torch.device) else int(device)
        if not 0 <= index < self.count:  # as CUDA answers an unknown device
            raise IndexError(f"no GPU {index}: {self.count} visible")
        return index

    def get_rng_state(self, device="cuda"):
        return torch.tensor([self._index(device), 7], dtype=torch.uint8)

    def set_rng_state(self, state, device="cuda"):
        self.set_calls.append((state.tolist(), self._index(device)))


def test_rng_state_of_8_gpus_resumes_on_1(monkeypatch):
    fake = _FakeCudaRng(monkeypatch, count=8)
    saved = run_state.capture_rng_state([torch.device("cuda", 5)])
    assert [s.tolist() for s in saved["cuda_devices"]] == [[5, 7]]  # its GPU only
    assert "cuda" not in saved
    fake.count = 1  # srun --gpus-per-task=1: the resumed rank sees its GPU as 0
    run_state.restore_rng_state(saved, [torch.device("cuda", 0)])
    assert fake.set_calls == [([5, 7], 0)]


def test_rng_states_of_every_data_parallel_gpu(monkeypatch):
    fake = _FakeCudaRng(monkeypatch, count=4)
    gpus = [torch.device("cuda", i) for i in (0, 1)]
    saved = run_state.capture_rng_state(gpus)
    run_state.restore_rng_state(saved, gpus)
    assert fake.set_calls == [([0, 7], 0), ([1, 7], 1)]
    fake.set_calls.clear()
    run_state.restore_rng_state(
        run_state.capture_rng_state([torch.device("cpu")]), gpus
    )
    assert fake.set_calls == []  # saved on the CPU: the GPUs keep theirs


def test_old_checkpoints_with_every_gpus_rng_state_still_resume(monkeypatch):
    fake = _FakeCudaRng(monkeypatch, count=8)
    old = run_state.capture_rng_state()
    old["cuda"] = [fake.get_rng_state(i) for i in range(8)]  # saved before
    fake.count = 4  # 2 nodes x 4 GPUs instead of 1 x 8
    run_state.restore_rng_state(old, [torch.device("cuda", 3)])
    run_state.restore_rng_state(old, [torch.device("cpu")])  # no GPU: CPU state only
    assert fake.set_calls == [([3, 7], 3)]
    fake.set_calls.clear()
    old["cuda"] = old["cuda"][:2]  # fewer states than this device's index
    run_state.restore_rng_state(old, [torch.device("cuda", 3)])
    assert fake.set_calls == []


# --- More processes on a node than visible GPUs -----------------------------


# Rank 0 of 8 on one node: the rank that reports.
_TORCHRUN_8 = {"RANK": "0", "WORLD_SIZE": "8", "LOCAL_RANK": "0",
               "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "127.0.0.1"}  # fmt: skip
_SRUN_8 = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_LOCALID": "0",
           "SLURM_NODELIST": "localhost", "SLURM_TASKS_PER_NODE": "8",
           "SLURM_NODEID": "0", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "1"}  # fmt: skip


@pytest.mark.parametrize(
    "local_rank, local_world, visible, node_gpus, expected",
    [
        (0, 1, 1, None, 0),
        (5, 8, 1, None, 0),  # one GPU bound to each task: its cuda:0
        (3, 4, 4, None, 3),
        (1, 2, 8, None, 1),
        (5, 8, 4, None, None),  # 8 processes, 4 GPUs seen by all
        (0, 8, 4, None, None),
        (2, 1, 2, None, None),
        (5, 8, 4, 4, None),  # --gres=gpu:4 and 8 tasks: every task sees all 4
        (3, 4, 2, 8, 1),  # --gpus-per-task=2: each task sees its own pair
        (5, 8, 4, 8, 1),  # --gpu-bind=closest: a socket's 4 of the node's 8
    ],
)
def test_gpu_index(local_rank, local_world, visible, node_gpus, expected):
    if expected is None:
        with pytest.raises(LaunchError, match=f"{visible} GPUs are visible"):
            du.gpu_index(local_rank, local_world, visible, node_gpus)
    else:
        assert du.gpu_index(local_rank, local_world, visible, node_gpus) == expected


def test_slurm_gpus_on_node_and_a_launcher_without_local_world_size():
    slurm = du.detect_launch({**_SRUN_8, "SLURM_GPUS_ON_NODE": "8"})
    assert (slurm.local_world_size, slurm.node_gpus) == (8, 8)
    assert du.detect_launch(_SRUN_8).node_gpus is None
    # One process per node or container (RANK and WORLD_SIZE only): 8 GPUs
    # seen, world of 16, and nothing to refuse.
    alone = du.detect_launch({"RANK": "3", "WORLD_SIZE": "16"})
    assert alone.local_world_size == 1
    assert du.gpu_index(alone.local_rank, alone.local_world_size, 8) == 0


@pytest.mark.parametrize(
    "text, node, expected",
    [
        ("8", 0, 8),
        ("2(x4)", 3, 2),
        ("4(x2),1", 2, 1),
        ("4(x2),1", 1, 4),
        ("3,5", 1, 5),
    ],
)
def test_tasks_on_node(text, node, expected):
    assert du.tasks_on_node(text, node) == expected


def test_slurm_local_world_is_this_nodes_tasks():
    env = {"SLURM_PROCID": "9", "SLURM_NTASKS": "10", "SLURM_LOCALID": "1",
           "SLURM_NODELIST": "gpu[1-3]", "SLURM_TASKS_PER_NODE": "4(x2),2",
           "SLURM_NODEID": "2", "SLURM_STEP_ID": "0"}  # fmt: skip
    assert du.detect_launch(env).local_world_size == 2


def _fake_gpus(monkeypatch, count: int, set_device_calls: list | None = None):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    record = set_device_calls.append if set_device_calls is not None else None
    monkeypatch.setattr(torch.cuda, "set_device", record or (lambda device: None))


def test_one_visible_gpu_per_task_is_cuda_0(monkeypatch):
    calls: list = []
    _fake_gpus(monkeypatch, 1, calls)
    assert du.select_device("auto", 5, 8, 8) == torch.device("cuda", 0)
    assert calls == [torch.device("cuda", 0)]


@pytest.mark.parametrize("launcher", ["torchrun", "srun", "num-procs"])
def test_more_processes_than_gpus_exits_2_naming_the_counts(
    monkeypatch, tmp_path, launcher
):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name in [key for key in os.environ if key.startswith("SLURM")]:
        monkeypatch.delenv(name)
    env = {"torchrun": _TORCHRUN_8, "srun": _SRUN_8}.get(launcher, {})
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # nobody answers there
    _fake_gpus(monkeypatch, 4)
    args = ["--num-procs", "8"] if launcher == "num-procs" else []
    result = call_main(*args, *TINY, "OUT_DIR", str(tmp_path / "out"),
                       "DIST.INIT_TIMEOUT", "5")  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "8 processes on this node" in result.stderr
    assert "4 GPUs are visible" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_exits_2(tmp_path):
    result = call_main(*TINY, "DEVICE", "cuda", "OUT_DIR", str(tmp_path / "out"))
    assert result.returncode == 2
    assert "DEVICE cuda, but CUDA is not available" in result.stderr
    assert not (tmp_path / "out").exists()


# --- CUDNN.DETERMINISTIC turns CUDNN.BENCHMARK off --------------------------


@pytest.fixture
def cudnn_flags_kept(monkeypatch):
    """Put cuDNN's flags and deterministic mode back after the test."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    flags = torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic
    determinism = torch.are_deterministic_algorithms_enabled()
    yield
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = flags
    torch.use_deterministic_algorithms(determinism)


@pytest.mark.parametrize(
    "benchmark, deterministic, expected",
    [
        (True, True, (False, True)),
        (True, False, (True, False)),
        (False, False, (False, False)),
        (False, True, (False, True)),
    ],
)
def test_cudnn_flags_of_a_gpu_run(
    monkeypatch, capsys, cudnn_flags_kept, benchmark, deterministic, expected
):
    calls: list = []
    fake = _fake_setup(calls, torch.device("cuda", 0))
    monkeypatch.setattr(du, "setup_distributed", fake)
    asked = []  # an Ampere GPU: TRAIN.MIXED_PRECISION auto is bf16 there
    monkeypatch.setattr(
        precision, "cuda_capability", lambda d: asked.append(d) or (8, 0)
    )
    cfg = get_cfg()
    cfg.CUDNN.BENCHMARK, cfg.CUDNN.DETERMINISTIC = benchmark, deterministic
    with session.run_context(cfg, log_files=False):
        flags = torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic
    assert flags == expected
    out = capsys.readouterr().out  # the run's precision: auto resolved, logged
    resolved = "TRAIN.MIXED_PRECISION auto on cuda:0: bf16" in out
    assert resolved and asked == [torch.device("cuda", 0)]
    said = "CUDNN.BENCHMARK turned off" in out
    assert said == (benchmark and deterministic)


# --- The gloo side group of an NCCL run -------------------------------------


def _side_group(rank: int, world: int, interface: str) -> dict:
    """Form the side group as over an NCCL default group (whose backend
    config has no CPU part), on real gloo ranks."""
    real = dist.get_backend_config
    dist.get_backend_config = lambda group=None: "cuda:nccl"
    if interface:
        os.environ["GLOO_SOCKET_IFNAME"] = interface
    try:
        collectives.join_control_group(rank, 10)
    except DistributedSetupError as error:
        return {"error": str(error)}
    finally:
        dist.get_backend_config = real
        os.environ.pop("GLOO_SOCKET_IFNAME", None)
    formed = du.control_group() is not None
    return {"formed": formed, "max": du.all_reduce_max_int(rank + 10)}


@pytest.mark.distributed
@pytest.mark.slow
def test_side_group_forms_at_start_up(tmp_path):
    results = run_on_ranks(2, _side_group, ("",), str(tmp_path))
    assert results == [{"formed": True, "max": 11}] * 2


@pytest.mark.slow
def test_side_group_that_cannot_form_names_gloo_socket_ifname(tmp_path):
    results = run_on_ranks(1, _side_group, ("nosuchif0",), str(tmp_path))
    message = results[0]["error"]
    assert "GLOO_SOCKET_IFNAME" in message and "DIST.INIT_TIMEOUT=10s" in message
    assert "nosuchif0" in message  # gloo's own reason


def _setup_with_a_failing_side_group(out_dir: str) -> None:
    """setup_distributed (under torchrun's environment) whose side
    group cannot form; writes what this rank saw."""
    dist.get_backend_config = lambda group=None: "cuda:nccl"  # as over NCCL

    def refuse(*args, **kwargs):
        raise RuntimeError("[../gloo/transport/tcp/pair.cc:446] Connect timeout")

    dist.new_group = refuse
    try:
        du.setup_distributed("", "cpu", 10)
        seen = {"error": None}
    except DistributedSetupError as error:
        seen = {"error": str(error)}
    seen["group_left"] = not dist.is_initialized()
    rank = os.environ["RANK"]
    torch.save(seen, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.distributed
@pytest.mark.slow
def test_setup_that_fails_on_the_side_group_leaves_the_process_group(tmp_path):
    run_launched(2, _setup_with_a_failing_side_group, (str(tmp_path),))
    for rank in (0, 1):
        seen = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert "Connect timeout" in seen["error"]
        assert "GLOO_SOCKET_IFNAME" in seen["error"]
        assert seen["group_left"]


# --- Whole runs on real GPUs (skipped without them) --------------------------
# What a session with a GPU machine runs first: pytest tests/test_gpu_path.py


def _gpu_run(out: str, extra: str, processes: int = 1):
    """TINY on CUDA into ``out`` with the KEY VALUE words of ``extra``."""
    args = [*TINY, "DEVICE", "cuda", "OUT_DIR", out, *extra.split()]
    if processes > 1:
        return torchrun(processes, *args)
    return train_net_command(*args)


@pytest.mark.slow
@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize(
    "extra",
    [
        "TRAIN.MIXED_PRECISION fp16 MODEL.EMA True OPTIM.CLIP_GRAD_NORM 1.0",
        "TRAIN.MIXED_PRECISION bf16 TRAIN.MIXUP_ALPHA 0.2 TRAIN.CUTMIX_ALPHA 1.0",
    ],
)
def test_one_gpu_trains(tmp_path, extra):
    out = str(tmp_path / "out")
    assert_ok(_gpu_run(out, extra))
    (val,) = read_metrics(out, "val")
    assert val["samples"] == 101


@pytest.mark.slow
@pytest.mark.cuda
@needs_cuda
def test_deterministic_gpu_runs_repeat_bitwise(tmp_path):
    weights = []
    for name in ("a", "b"):
        out = str(tmp_path / name)
        assert_ok(_gpu_run(out, "RNG_SEED 3 CUDNN.DETERMINISTIC True"))
        weights.append(cp.load_file(os.path.join(out, cp.BEST_WEIGHTS))["model"])
    for key, value in weights[0].items():
        assert torch.equal(value, weights[1][key]), key


@pytest.mark.slow
@pytest.mark.cuda
@needs_two_gpus
@pytest.mark.parametrize(
    "extra",
    [
        "MODEL.SYNCBN True TRAIN.MIXED_PRECISION fp16",
        "DIST.STRATEGY fsdp DIST.FSDP_CPU_OFFLOAD True OPTIM.CLIP_GRAD_NORM 1.0 "
        "TRAIN.MIXED_PRECISION bf16",
        "DIST.STRATEGY zero1 MODEL.EMA True",
    ],
)
def test_two_gpus_train_with_nccl(tmp_path, extra):
    out = str(tmp_path / "out")
    assert_ok(_gpu_run(out, "MODEL.ARCH resnet8 " + extra, processes=2))
    (val,) = read_metrics(out, "val")
    assert val["samples"] == 101 and len(val["peak_mem_mb"]) == 2


@pytest.mark.slow
@pytest.mark.cuda
@needs_two_gpus
def test_dp_bf16_run_on_two_gpus(tmp_path):
    out = str(tmp_path / "out")
    assert_ok(_gpu_run(out, "DIST.MODE dp TRAIN.MIXED_PRECISION bf16"))


# --- Process groups of a finished run are released before exit --------------


def _gloo_threads() -> list[str]:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm", encoding="utf-8") as f:
                names.append(f.read().strip())
        except OSError:
            continue
    return sorted(name for name in names if "gloo" in name)


def _fsdp_step_then_release(out_dir: str, release: bool) -> None:
    """An FSDP2 training step on gloo ranks (with torchrun's environment),
    then what a finished run does: leave the group, drop the model, release
    the groups; writes the gloo threads left."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    info, _ = du.setup_distributed("", "cpu", 30)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    fully_shard(model, mesh=init_device_mesh("cpu", (info.world_size,)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    du.all_reduce_max_int(info.rank)  # a last all-reduce of a Python tensor
    du.cleanup_distributed()
    del model, optimizer
    if release:
        du.release_groups()
    torch.save(_gloo_threads(), os.path.join(out_dir, f"rank{info.rank}.pt"))


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("release", [False, True])
def test_a_finished_fsdp_run_leaves_no_gloo_threads_behind(tmp_path, release):
    """Without the release, DTensor's caches keep the device mesh and its
    group, whose gloo threads then live on into interpreter exit."""
    run_launched(2, _fsdp_step_then_release, (str(tmp_path), release))
    for rank in (0, 1):
        threads = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert bool(threads) is not release, threads
