"""DIST.STRATEGY deepspeed: evaluation is exact on any number of processes,
checkpoints resume (on another world size too) and are read by the other
tools, DeepSpeed's launcher starts it, and bad input is refused before
anything is written (ZeRO 1-3 and offload trained against DDP:
test_deepspeed_training.py)."""

from __future__ import annotations

import json
import os
import shlex
import shutil

import pytest
import torch
from fake_devices import FakeCuda, GpuShyLinear
from helpers import (
    REPO,
    TINY_VAL_SIZE,
    TRAIN_NET,
    assert_ok,
    call_main,
    free_port,
    needs_deepspeed,
    read_metrics,
    refused,
    run_python,
    the_zygote,
    torchrun,
    train_net,
)

from distribuuuu.dist import group as du
from distribuuuu.engine.specs import strategy_spec
from distribuuuu.strategies import deepspeed as deepspeed_strategy
from distribuuuu.strategies.chain import takes_fp16
from distribuuuu.strategies.deepspeed_config import generated_config, merge
from distribuuuu.strategies.precision import auto_precision

# One epoch of LeNet-5 on the embedded digits, 2 processes x 64.
LENET = ["MODEL.ARCH", "lenet5", "OPTIM.MAX_EPOCH", "1", "RNG_SEED", "3"]
LENET += ["TRAIN.PRINT_FREQ", "100"]
DEEPSPEED = ["DIST.STRATEGY", "deepspeed"]


@needs_deepspeed
@pytest.mark.distributed
@pytest.mark.slow
def test_zero3_on_1_and_3_processes_counts_every_val_image_alike(tmp_path):
    """Global batch 192 as 1 x 192 and 3 x 64: ZeRO-3 evaluates all 101 images
    (uneven over 3 ranks, whose forward passes gather parameters together)
    and gives the same val loss (2 steps of 384 synthetic images before)."""
    keys = [*LENET, *DEEPSPEED, "DIST.DEEPSPEED.ZERO_STAGE", "3"]
    keys += ["DATA.NAME", "synthetic", "DATA.SYNTHETIC_SIZE", f"[384,{TINY_VAL_SIZE}]"]
    one, three = str(tmp_path / "one"), str(tmp_path / "three")
    assert_ok(train_net(*keys, "TRAIN.BATCH_SIZE", "192", "OUT_DIR", one))
    assert_ok(torchrun(3, *keys, "TRAIN.BATCH_SIZE", "64", "OUT_DIR", three))
    val_one, val_three = read_metrics(one, "val")[-1], read_metrics(three, "val")[-1]
    assert val_one["samples"] == val_three["samples"] == TINY_VAL_SIZE
    assert val_three["loss"] == pytest.approx(val_one["loss"], rel=1e-4)


# A checkpoint every 10 steps, the last 2 kept.
KEEP = ["CHECKPOINT.PERIOD_ITERS", "10", "CHECKPOINT.KEEP", "2"]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """One epoch of LENET on 2 ranks started by DeepSpeed's own launcher
    (``deepspeed --num_gpus 2``), with :data:`KEEP`: its result, its OUT_DIR
    (copy it before writing there) and its master port.  The launcher's test,
    the checkpoint's and the crafted file's share it."""
    folder = tmp_path_factory.mktemp("launched")
    out = str(folder / "run")
    port = free_port()
    launcher = ["-m", "deepspeed.launcher.runner", "--num_gpus", "2"]
    launcher += ["--master_port", str(port), "--no_python", rank_script(folder)]
    args = [*LENET, *DEEPSPEED, *KEEP, "OUT_DIR", out]
    return run_python([*launcher, *args]), out, port


def rank_script(folder) -> str:
    """What the launcher runs (``--no_python``) as each rank, with
    ``--local_rank=N ARGS``: ``python tools/train_net.py --local_rank=N
    ARGS`` forked from the zygote (tests/zygote.py), as torchrun's are."""
    path = folder / "train_net.sh"
    command = shlex.join([*the_zygote().worker_command(), TRAIN_NET])
    path.write_text(f'#!/bin/sh\nexec {command} "$@"\n')
    path.chmod(0o755)
    return str(path)


def _copy(out: str, tmp_path) -> str:
    """A copy of the run in ``out`` to write to."""
    return shutil.copytree(out, str(tmp_path / "run"))


@needs_deepspeed
@pytest.mark.distributed
@pytest.mark.slow
def test_a_checkpoint_of_2_ranks_goes_on_in_1_and_is_read_by_the_tools(
    tmp_path, launched
):
    """On another world size the whole fp32 weights are loaded (the optimizer
    state afresh); --eval-only under ddp and the inspector read the same file."""
    result, run, _ = launched
    assert_ok(result)
    out = _copy(run, tmp_path)
    first = read_metrics(out, "val")[-1]
    kept = sorted(os.listdir(os.path.join(out, "checkpoints")))
    assert kept == [
        "ckpt_ep_0000_it_0030.ds", "ckpt_ep_0000_it_0030.pth",
        "ckpt_ep_0001.ds", "ckpt_ep_0001.pth", "last", "scores.json",
    ]  # fmt: skip
    checkpoint = os.path.join(out, "checkpoints", "ckpt_ep_0001.pth")
    assert os.path.isdir(os.path.join(out, "checkpoints", "ckpt_ep_0001.ds", "zero"))
    evaluated = train_net(
        "--eval-only", "MODEL.ARCH", "lenet5", "MODEL.WEIGHTS", checkpoint,
        "OUT_DIR", str(tmp_path / "eval"),
    )  # fmt: skip
    assert_ok(evaluated)
    assert f"loss {first['loss']:.4f}" in evaluated.stdout
    inspected = run_python([f"{REPO}/tools/inspect_ckpt.py", checkpoint], timeout=120)
    assert_ok(inspected)
    assert "lenet5" in inspected.stdout
    more = ["OPTIM.MAX_EPOCH", "2", "TRAIN.AUTO_RESUME", "True", *KEEP]
    resumed = train_net(*LENET, *DEEPSPEED, *more, "OUT_DIR", out)
    assert_ok(resumed)
    assert "resuming on 1 processes instead of 2" in resumed.stdout
    assert "holds no optimizer state this strategy reads: it starts afresh" in (
        resumed.stdout
    )
    second = read_metrics(out, "val")[-1]
    assert second["epoch"] == 2 and second["samples"] == 1000
    assert second["loss"] < first["loss"]  # it went on from the saved weights


@needs_deepspeed
@pytest.mark.distributed
@pytest.mark.slow
def test_the_deepspeed_launcher_starts_it(launched):
    """DeepSpeed's own launcher (``deepspeed --num_gpus 2``, which passes
    --local_rank and sets LOCAL_SIZE) is detected, with a CPU thread each."""
    result, out, port = launched
    assert_ok(result)
    assert "launcher deepspeed" in result.stdout
    assert "1 CPU thread(s) per process" in result.stdout
    assert read_metrics(out, "val")[-1]["samples"] == 1000
    # Its shared-memory all-reduce buffers (one per rank) are not left behind.
    left = [name for name in os.listdir("/dev/shm") if f"_{port}_" in name]
    assert not left, left


class _Marker:
    """Pickles as a call that creates a file when unpickled."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


@needs_deepspeed
@pytest.mark.slow
def test_a_crafted_deepspeed_file_is_refused_before_anything_runs(tmp_path, launched):
    """The launched run's newest DeepSpeed file replaced by a pickle that runs
    code; resuming is refused (in this process: exit 2 before anything runs)."""
    result, run, _ = launched
    assert_ok(result)
    out, marker = _copy(run, tmp_path), str(tmp_path / "marker")
    files = os.path.join(out, "checkpoints", "ckpt_ep_0001.ds", "zero")
    target = os.path.join(files, "mp_rank_00_model_states.pt")
    assert os.path.isfile(target)
    torch.save({"module": _Marker(marker)}, target, pickle_protocol=2)
    log = os.path.join(out, "log.txt")
    size = os.path.getsize(log)
    result = call_main(*LENET, *DEEPSPEED, *KEEP, "OPTIM.MAX_EPOCH", "2",
                       "TRAIN.AUTO_RESUME", "True", "OUT_DIR", out)  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "refused" in errors[0] and "posix.system" in errors[0]
    assert not os.path.exists(marker)
    assert os.path.getsize(log) == size  # nothing written


# --- refused before anything is written (exit 2, one error line) ----------- #
def _refused(tmp_path, *keys: str) -> str:
    return refused(str(tmp_path / "out"), *LENET, *DEEPSPEED, *keys)


def _json(tmp_path, text: str) -> str:
    path = tmp_path / "ds_config.json"
    path.write_text(text, encoding="utf-8")
    return str(path)


@pytest.mark.parametrize(
    "keys, words",
    [
        (["DIST.DEEPSPEED.ZERO_STAGE", "4"], "DIST.DEEPSPEED.ZERO_STAGE 4 is invalid"),
        (["DIST.DEEPSPEED.OFFLOAD_OPTIMIZER", "disk"], "choose one of none, cpu"),
        (["DIST.DEEPSPEED.OFFLOAD_PARAMS", "cpu"], "needs DIST.DEEPSPEED.ZERO_STAGE 3"),
        (
            ["DIST.DEEPSPEED.OFFLOAD_OPTIMIZER", "nvme"],
            "needs DIST.DEEPSPEED.NVME_PATH",
        ),
        (
            ["DIST.DEEPSPEED.ZERO_STAGE", "3", "MODEL.EMA", "True"],
            "MODEL.EMA True is invalid: is not supported with DIST.DEEPSPEED",
        ),
        (
            ["TRAIN.MIXED_PRECISION", "fp16"],
            "'fp16' is invalid: is not supported with DIST.STRATEGY deepspeed",
        ),
    ],
    ids=["stage", "offload", "params-offload", "nvme", "zero3-ema", "fp16"],
)
def test_bad_keys_are_refused(tmp_path, keys, words):
    assert words in _refused(tmp_path, *keys)


def test_auto_precision_before_ampere_is_fp32_not_fp16():
    """fp16 is refused under DeepSpeed, so TRAIN.MIXED_PRECISION auto on a
    V100 (compute capability 7.0) trains in fp32; bf16 from Ampere on."""
    allowed, gpu = takes_fp16(strategy_spec(_cfg())), torch.device("cuda", 0)
    assert auto_precision(gpu, allowed, lambda _: (7, 0)) == "none"
    assert auto_precision(gpu, allowed, lambda _: (8, 0)) == "bf16"


def test_nvme_path_that_is_not_a_writable_directory(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("")
    keys = ["DIST.DEEPSPEED.OFFLOAD_OPTIMIZER", "nvme"]
    line = _refused(tmp_path, *keys, "DIST.DEEPSPEED.NVME_PATH", str(a_file))
    assert "is not a writable directory" in line


@pytest.mark.parametrize(
    "text, words",
    [
        ('{"zero_optimization": {"stage": 3', "not JSON"),
        ("[1, 2]", "must hold a JSON object, not list"),
        (
            '{"zero_optimization": {"stage": 3}}',
            "zero_optimization.stage 3 contradicts DIST.DEEPSPEED.ZERO_STAGE",
        ),
        ('{"gradient_clipping": 1.0}', "contradicts OPTIM.CLIP_GRAD_NORM"),
        ('{"bf16": {"enabled": true}}', "contradicts TRAIN.MIXED_PRECISION"),
        ('{"optimizer": {"type": "Adam"}}', "'optimizer' section contradicts OPTIM"),
    ],
    ids=["truncated", "list", "stage", "clip", "bf16", "optimizer"],
)
def test_user_json_that_is_bad_or_contradicts_our_keys(tmp_path, text, words):
    path = _json(tmp_path, text)
    line = _refused(tmp_path, "DIST.DEEPSPEED.CONFIG", path)
    assert words in line and "DIST.DEEPSPEED.CONFIG" in line


# Sections with which DeepSpeed would write files of its own, or change how it
# reads checkpoints (universal loading unpickles by itself).
WRITING_SECTIONS = {
    "flops_profiler": {"enabled": True, "output_file": "/tmp/profile.txt"},
    "tensorboard": {"enabled": True, "output_path": "/tmp/elsewhere"},
    "csv_monitor": {"enabled": True, "output_path": "/tmp/elsewhere"},
    "wandb": {"enabled": True, "project": "x"},
    "comet": {"enabled": True},
    "checkpoint": {"load_universal": True},
    "autotuning": {"enabled": True, "results_dir": "/tmp/elsewhere"},
}


@pytest.mark.parametrize("section", WRITING_SECTIONS)
def test_a_json_section_beyond_the_engine_is_refused(section):
    ours = generated_config(strategy_spec(_cfg()), world_size=1)
    with pytest.raises(ValueError) as caught:
        merge(ours, {section: WRITING_SECTIONS[section]})
    message = str(caught.value)
    assert f"its '{section}' section is not passed to DeepSpeed" in message
    assert "Allowed: aio, bf16, communication_data_type," in message
    assert "wall_clock_breakdown, zero_allow_untested_optimizer" in message


@needs_deepspeed
def test_a_profiler_json_is_refused_before_anything_is_written(tmp_path):
    """Exit 2, one line naming the section and those allowed; the file the
    profiler would overwrite is intact and the monitor's folder not made."""
    victim, elsewhere = tmp_path / "mine.txt", tmp_path / "elsewhere"
    victim.write_text("mine\n")
    config = {
        "flops_profiler": {"enabled": True, "output_file": str(victim)},
        "csv_monitor": {"enabled": True, "output_path": str(elsewhere)},
    }
    line = _refused(
        tmp_path, "DIST.DEEPSPEED.CONFIG", _json(tmp_path, json.dumps(config))
    )
    assert "'flops_profiler' section" in line and "Allowed: aio," in line
    assert victim.read_text() == "mine\n" and not elsewhere.exists()


def test_missing_deepspeed_is_named_with_its_extra(tmp_path):
    """DeepSpeed made unimportable in the process running the command."""
    out = str(tmp_path / "out")
    script = tmp_path / "without_deepspeed.py"
    script.write_text(
        "import runpy, sys; sys.modules['deepspeed'] = None; "
        f"sys.argv = ['train_net.py', *{[*LENET, *DEEPSPEED, 'OUT_DIR', out]!r}]; "
        f"runpy.run_path({TRAIN_NET!r}, run_name='__main__')"
    )
    result = run_python([str(script)], timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "pip install -e '.[deepspeed]'" in result.stderr
    assert not os.path.exists(out)


# --- the generated config and the merge ------------------------------------ #
def _cfg(*keys):
    from distribuuuu.config import get_cfg

    cfg = get_cfg()
    cfg.merge_from_list([*DEEPSPEED, *keys])
    return cfg


def test_generated_config_follows_our_keys():
    cfg = _cfg(
        "TRAIN.BATCH_SIZE", "16", "TRAIN.ACCUM_STEPS", "4",
        "OPTIM.CLIP_GRAD_NORM", "2.5", "TRAIN.MIXED_PRECISION", "bf16",
        "DIST.DEEPSPEED.ZERO_STAGE", "3", "DIST.DEEPSPEED.OFFLOAD_PARAMS", "nvme",
        "DIST.DEEPSPEED.NVME_PATH", "/nvme",
    )  # fmt: skip
    config = generated_config(strategy_spec(cfg), world_size=8)
    assert config["train_micro_batch_size_per_gpu"] == 16
    assert config["gradient_accumulation_steps"] == 4
    assert config["train_batch_size"] == 16 * 4 * 8
    assert config["gradient_clipping"] == 2.5
    # Autocast over fp32 weights; DeepSpeed's bf16 mode casts the parameters
    # but not BatchNorm's buffers.
    assert config["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}
    assert config["bf16"] == config["fp16"] == {"enabled": False}
    zero = config["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_param"] == {"device": "nvme", "nvme_path": "/nvme"}
    assert zero["offload_optimizer"] == {"device": "none"}


def test_merge_adds_what_we_have_no_key_for_and_accepts_agreeing_values():
    ours = generated_config(strategy_spec(_cfg()), world_size=2)
    theirs = {
        "zero_optimization": {"stage": 2, "overlap_comm": True},
        "gradient_clipping": 0,  # 0 and 0.0 agree
        "wall_clock_breakdown": True,
    }
    merged = merge(ours, theirs)
    assert merged["zero_optimization"]["overlap_comm"] is True
    assert merged["zero_optimization"]["offload_optimizer"] == {"device": "none"}
    assert merged["wall_clock_breakdown"] is True
    with pytest.raises(ValueError, match="offload_optimizer.device"):
        merge(ours, {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}})
    with pytest.raises(ValueError, match="fp16.enabled 1 contradicts"):
        merge(ours, {"fp16": {"enabled": 1}})  # 1 is not false, nor true
    with pytest.raises(ValueError, match="torch_autocast.enabled true contradicts"):
        merge(ours, {"torch_autocast": {"enabled": True}})


@needs_deepspeed
def test_deepspeed_builds_no_shared_memory_all_reduce_on_the_cpu():
    """DeepSpeed's CPU shared-memory all-reduce (inference only; a C++ build of
    minutes and a /dev/shm buffer per rank) is not built: deepspeed.comm asks
    deepspeed.ops's table of compatible ops, where the strategy marks it off.
    A DeepSpeed release that decides elsewhere fails here, naming it."""
    deepspeed = deepspeed_strategy.import_deepspeed(torch.device("cpu"))
    deepspeed_strategy.skip_inference_all_reduce(deepspeed)
    from deepspeed.comm.torch import build_shm_op
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    assert ShareMemCommBuilder.NAME == deepspeed_strategy.SHM_COMM_OP

    assert build_shm_op() is None, (
        "DeepSpeed no longer asks deepspeed.ops.__compatible_ops__ before it "
        "builds its CPU shared-memory op: see skip_inference_all_reduce"
    )


# --- the GPU DeepSpeed is given (fakes: DeepSpeed's engine cannot be built
# on meta, and there is no GPU here) ----------------------------------------- #
class _FakeDeepSpeed:
    """The deepspeed calls that prepare_model makes.  ``initialize`` does what
    DeepSpeed's engine does with the device: it makes the GPU of LOCAL_RANK
    current (or GPU ``makes_current``, as a library gone astray would)."""

    def __init__(self, cuda: FakeCuda, makes_current: int | None):
        self.cuda, self.makes_current = cuda, makes_current
        self.local_rank = ""  # LOCAL_RANK as initialize saw it

    def init_distributed(self, **kwargs) -> None:
        pass

    def initialize(self, model, optimizer, config):
        self.local_rank = os.environ["LOCAL_RANK"]
        index = self.makes_current
        self.cuda.set_device(int(self.local_rank) if index is None else index)
        return model, optimizer, None, None


def _returning(value):
    """A function of any arguments that returns ``value``."""
    return lambda *args, **kwargs: value


def _slurm_task(monkeypatch, local_rank: int, visible: int, makes_current=None):
    """The DeepSpeed strategy of Slurm task ``local_rank`` of 2 on a node of 4
    GPUs, seeing ``visible`` of them, in a process group of 2; the fake
    DeepSpeed it will call."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    env = {"SLURM_PROCID": local_rank, "SLURM_NTASKS": 2, "SLURM_LOCALID": local_rank}
    env |= {"SLURM_STEP_ID": 0, "SLURM_NODELIST": "node1", "SLURM_NODEID": 0}
    env |= {"SLURM_TASKS_PER_NODE": 2, "SLURM_GPUS_ON_NODE": 4}
    for name, value in env.items():
        monkeypatch.setenv(name, str(value))
    cuda = FakeCuda(visible).install(monkeypatch)
    info = du.detect_launch()
    device = du.select_device("auto", info.local_rank, 2, info.node_gpus)
    group = {"is_initialized": True, "get_world_size": 2, "get_rank": local_rank}
    for name, value in {**group, "get_backend": "nccl"}.items():
        monkeypatch.setattr(torch.distributed, name, _returning(value))
    fake = _FakeDeepSpeed(cuda, makes_current)
    monkeypatch.setattr(deepspeed_strategy, "import_deepspeed", lambda device: fake)
    strategy = deepspeed_strategy.DeepSpeedStrategy(strategy_spec(_cfg(), device))
    return strategy, fake


def test_a_task_bound_to_one_gpu_gives_deepspeed_that_gpu(monkeypatch):
    """srun --gpus-per-task=1: task 1 of the node sees its one GPU as cuda:0;
    DeepSpeed, which makes the GPU of LOCAL_RANK current, is given 0 (the local
    rank, 1, was an invalid device ordinal)."""
    strategy, deepspeed = _slurm_task(monkeypatch, local_rank=1, visible=1)
    assert strategy.device == torch.device("cuda", 0)
    strategy.prepare_model(GpuShyLinear())
    assert deepspeed.local_rank == "0"
    assert torch.cuda.current_device() == 0


def test_a_gpu_deepspeed_makes_current_other_than_ours_is_an_error(monkeypatch):
    """Task 1 bound to 2 of the node's 4 GPUs runs on its second, cuda:1; an
    engine that makes cuda:0 current stops the run, naming both."""
    strategy, _ = _slurm_task(monkeypatch, local_rank=1, visible=2, makes_current=0)
    assert strategy.device == torch.device("cuda", 1)
    with pytest.raises(RuntimeError) as caught:
        strategy.prepare_model(GpuShyLinear())
    assert "DeepSpeed made cuda:0 the current device" in str(caught.value)
    assert "not cuda:1, the one chosen for it" in str(caught.value)


def test_the_model_is_copied_for_its_shapes_before_it_moves_to_the_gpu(monkeypatch):
    """The GPU never holds the model twice: the meta skeleton is copied from
    the model still on the CPU."""
    strategy, _ = _slurm_task(monkeypatch, local_rank=0, visible=1)
    model = GpuShyLinear()
    strategy.prepare_model(model)
    assert model.moved_to == torch.device("cuda", 0)
    assert strategy.skeleton.moved_to is None and strategy.skeleton.weight.is_meta


# --- DeepSpeed's files walked before DeepSpeed unpickles them --------------- #
def _ds_folder(tmp_path, name: str, payload) -> str:
    folder = tmp_path / "ckpt_ep_0001.ds"
    (folder / "zero").mkdir(parents=True)
    torch.save(payload, str(folder / "zero" / name))
    return str(folder)


def test_deepspeed_files_of_plain_state_pass_and_crafted_ones_are_refused(tmp_path):
    from collections import OrderedDict

    from distribuuuu.checkpoint import check_deepspeed_files
    from distribuuuu.errors import RefusedCheckpointError

    plain = {"module": OrderedDict(w=torch.ones(2)), "ds_version": "0.19.8"}
    check_deepspeed_files(
        _ds_folder(tmp_path / "ok", "mp_rank_00_model_states.pt", plain)
    )
    crafted = {"module": _Marker(str(tmp_path / "marker"))}
    folder = _ds_folder(tmp_path / "code", "mp_rank_00_model_states.pt", crafted)
    with pytest.raises(RefusedCheckpointError, match="posix.system"):
        check_deepspeed_files(folder)
    other = _ds_folder(tmp_path / "name", "extra.pt", plain)
    with pytest.raises(RefusedCheckpointError, match="not a file DeepSpeed writes"):
        check_deepspeed_files(other)
    assert not os.path.exists(tmp_path / "marker")
