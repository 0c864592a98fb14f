"""Launch detection, the Slurm hostlist parser, and helpers without a group."""

from __future__ import annotations

import pytest
import torch

from distribuuuu.dist import group as du


@pytest.mark.parametrize(
    "hostlist, hosts",
    [
        ("node1", ["node1"]),
        ("node[1-3]", ["node1", "node2", "node3"]),
        ("node[01-03]", ["node01", "node02", "node03"]),
        ("node[098-101]", ["node098", "node099", "node100", "node101"]),
        ("node[01-02,07]", ["node01", "node02", "node07"]),
        ("a1,b[2-3]", ["a1", "b2", "b3"]),
        ("gpu-[1-2]-ib", ["gpu-1-ib", "gpu-2-ib"]),
        (
            "rack[1-2]-node[01-02]",
            ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"],
        ),
        ("x[1,3],y[10-11],z", ["x1", "x3", "y10", "y11", "z"]),
        ("10.0.0.[1-2]", ["10.0.0.1", "10.0.0.2"]),
        ("localhost", ["localhost"]),
        ("c[9-10]", ["c9", "c10"]),
    ],
)
def test_expand_hostlist(hostlist, hosts):
    assert du.expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("bad", ["node[1-3", "node1-3]", "node[3-1]", "node[a-b]"])
def test_expand_hostlist_rejects_malformed(bad):
    with pytest.raises(ValueError):
        du.expand_hostlist(bad)


SLURM = {
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_NODELIST": "gpu[03-06]",
    "SLURM_JOB_ID": "123456",
    "SLURM_TASKS_PER_NODE": "2(x4)",
}


def test_detect_slurm():
    info = du.detect_launch(SLURM)
    assert (info.launcher, info.rank, info.world_size, info.local_rank) == (
        "slurm",
        5,
        8,
        1,
    )
    assert info.local_world_size == 2
    assert info.master_addr == "gpu03"
    assert info.master_port == 20000 + 123456 % 20000


def test_detect_slurm_master_from_env_wins():
    info = du.detect_launch({**SLURM, "MASTER_ADDR": "head", "MASTER_PORT": "1234"})
    assert (info.master_addr, info.master_port) == ("head", 1234)


def test_two_slurm_jobs_get_different_ports():
    a = du.detect_launch({**SLURM, "SLURM_JOB_ID": "100"})
    b = du.detect_launch({**SLURM, "SLURM_JOB_ID": "101"})
    assert a.master_port != b.master_port


def test_torchrun_inside_slurm_is_torchrun():
    env = {
        **SLURM,
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "3",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "10.1.1.1",
        "MASTER_PORT": "29400",
    }
    info = du.detect_launch(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank) == (
        "torchrun",
        3,
        4,
        3,
    )
    assert (info.master_addr, info.master_port) == ("10.1.1.1", 29400)


def test_nothing_means_single_process():
    info = du.detect_launch({})
    assert (info.launcher, info.rank, info.world_size) == ("none", 0, 1)


def test_helpers_work_without_a_process_group():
    assert du.get_rank() == 0 and du.get_world_size() == 1 and du.is_main_process()
    du.barrier()
    t = torch.tensor([2.0, 4.0])
    assert du.all_reduce_sum(t.clone()).tolist() == [2.0, 4.0]
    assert du.all_reduce_mean(t.clone()).tolist() == [2.0, 4.0]
    assert du.all_gather_object({"a": 1}) == [{"a": 1}]
    assert du.broadcast_object(7) == 7


def test_setup_single_process_picks_cpu_without_group(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    info, device = du.setup_distributed("", "cpu", 10)
    assert info.launcher == "none" and device == torch.device("cpu")
    assert not torch.distributed.is_initialized()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_device_is_cuda_local_rank():
    assert du.select_device("auto", 0) == torch.device("cuda", 0)
