"""The planner's time half: the pipeline bubble against the schedules
played out, the cost model's monotone properties, the datasheet table, the
FLOP count of a known model, and the TFLOP/s and MFU a short run logs."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import types

import pytest
import torch
from helpers import TINY, call_main, read_metrics
from tensorboard.backend.event_processing import event_accumulator

from distribuuuu.bench.plan_timing import TimedPlan
from distribuuuu.models import build_model
from distribuuuu.plan import flops as plan_flops
from distribuuuu.plan.cost import Workload, bubble_fraction, pipeline_cost, step_cost
from distribuuuu.plan.devices import dense_peak_flops, find_device
from distribuuuu.plan.flops import BlockProfile, FlopMeter, ModelFlops, count_flops
from distribuuuu.plan.links import Cluster, Link

# A ViT-B/16-like model on paper: 12 equal blocks, 86 M parameters.
VIT_B = ModelFlops(
    forward=35.1e9,
    backward=70.2e9,
    conv_share=0.0,
    parameters=86_000_000,
    parameter_tensors=152,
    blocks=(BlockProfile(2.9e9, 7_087_872, 197 * 768),) * 12,
)
FAST = Link.of(800, 5)  # NVLink-like
SLOW = Link.of(10, 20)  # 10 Gbit/s between nodes


def cluster(nodes=1, per_node=8, intra=FAST, inter=SLOW, **keys) -> Cluster:
    return Cluster(nodes, per_node, intra, inter, flops_per_s=100e12, **keys)


def every_plan(world: int, batch: int = 32) -> list[TimedPlan]:
    """A plan of each strategy the cost model knows, on ``world`` ranks."""
    plan = functools.partial(TimedPlan, micro_batch=batch, accum_steps=2)
    half = world // 2
    return [
        plan("ddp", world),
        plan("zero1", world),
        plan("fsdp", world, act_ckpt=True),
        plan("hsdp", world, shard_size=max(world // 2, 1)),
        *(plan("deepspeed", world, zero_stage=stage) for stage in (1, 2, 3)),
        plan("ddp", half, tensor_parallel=2),
        plan("fsdp", half, tensor_parallel=2),
        *(
            plan("pipeline", half, pipeline_stages=2, pipeline_schedule=schedule)
            for schedule in ("gpipe", "1f1b", "interleaved_1f1b")
        ),
    ]


# --------------------------------------------------------------------------- #
# The bubble: the schedules played out, one unit of forward and two of
# backward per micro-batch and stage (split evenly over a process's chunks).
# --------------------------------------------------------------------------- #
def schedule_order(stages: int, micro: int, virtual: int, kind: str, device: int):
    """The (pass, chunk, micro-batch) a process runs, in its order: GPipe's
    all forwards then all backwards; 1F1B's warm-up forwards, then one
    forward, one backward; Megatron's interleaved 1F1B over ``virtual``
    chunks, micro-batches taken ``stages`` at a time per chunk."""
    if kind == "gpipe":
        return [("F", 0, m) for m in range(micro)] + [("B", 0, m) for m in range(micro)]
    total = micro * virtual

    def which(k: int, backward: bool):
        chunk = (k // stages) % virtual
        batch = (k // (stages * virtual)) * stages + k % stages
        return (
            "B" if backward else "F",
            virtual - 1 - chunk if backward else chunk,
            batch,
        )

    warm = stages - device - 1 if virtual == 1 else 2 * (stages - device - 1)
    warm = min(warm + (virtual - 1) * stages, total)
    order = [which(k, False) for k in range(warm)]
    for k in range(warm, total):
        order += [which(k, False), which(k - warm, True)]
    return order + [which(k, True) for k in range(total - warm, total)]


def played_bubble(stages: int, micro: int, virtual: int, kind: str) -> float:
    """The idle share of a schedule's step, each pass starting as soon as
    its process is free and its inputs are there."""
    orders = [schedule_order(stages, micro, virtual, kind, d) for d in range(stages)]
    done: dict = {}
    free, at = [0.0] * stages, [0] * stages
    while any(at[d] < len(orders[d]) for d in range(stages)):
        moved = False
        for d in range(stages):
            if at[d] == len(orders[d]):
                continue
            kind_, chunk, m = orders[d][at[d]]
            if kind_ == "F":
                need = [("F", d - 1, chunk, m)] if d else []
                need += [("F", stages - 1, chunk - 1, m)] if not d and chunk else []
            else:
                need = [("F", d, chunk, m)]
                need += [("B", d + 1, chunk, m)] if d < stages - 1 else []
                last = d == stages - 1 and chunk < virtual - 1
                need += [("B", 0, chunk + 1, m)] if last else []
            if all(n in done for n in need):
                cost = (1.0 if kind_ == "F" else 2.0) / virtual
                free[d] = max([free[d], *(done[n] for n in need)]) + cost
                done[(kind_, d, chunk, m)] = free[d]
                at[d], moved = at[d] + 1, True
        assert moved, "the schedule deadlocked"
    return 1 - micro * 3.0 / max(free)


@pytest.mark.parametrize(
    "kind,virtual",
    [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3)],
)
def test_the_bubble_is_the_one_the_schedules_leave(kind, virtual):
    """(S-1)/(VM+S-1) is what GPipe, 1F1B and interleaved 1F1B leave idle,
    and the pipeline's step cost carries that share of idle time."""
    for stages, per_stage in itertools.product((2, 4), (1, 2, 4)):
        micro = stages * per_stage
        played = played_bubble(stages, micro, virtual, kind)
        assert bubble_fraction(stages, micro, virtual) == pytest.approx(played)
        plan = TimedPlan(
            "pipeline", 1, micro * 4, pipeline_stages=stages, pipeline_schedule=kind
        )
        work = Workload(VIT_B, pipeline_microbatches=micro, virtual_stages=virtual)
        free = Link(0.0, float("inf"))
        cost = pipeline_cost(plan, work, cluster(1, stages, free, free))
        assert cost.bubble_s / cost.step_s == pytest.approx(played)


def test_more_micro_batches_and_chunks_shrink_the_bubble():
    assert bubble_fraction(4, 8) < bubble_fraction(4, 4)
    assert bubble_fraction(4, 8, virtual=2) < bubble_fraction(4, 8)
    assert bubble_fraction(1, 8) == 0


# --------------------------------------------------------------------------- #
# Monotone properties
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("nodes,per_node", [(1, 8), (2, 4), (4, 2)])
def test_a_faster_link_never_makes_a_step_slower(nodes, per_node):
    work = Workload.of(VIT_B, torch.bfloat16)
    assert (work.compute_param_bytes, work.activation_bytes) == (2, 2)
    for overlap, plan in itertools.product((False, True), every_plan(nodes * per_node)):
        base = cluster(nodes, per_node, overlap=overlap)
        slow = step_cost(plan, work, base).step_s
        for link in ("intra", "inter"):
            old = getattr(base, link)
            for faster in (
                Link(old.latency_s / 4, old.bytes_per_s),
                Link(old.latency_s, old.bytes_per_s * 4),
            ):
                quick = dataclasses.replace(base, **{link: faster})
                assert step_cost(plan, work, quick).step_s <= slow * (1 + 1e-12), (
                    plan,
                    link,
                )


@pytest.mark.parametrize("gbit", [0.1, 1, 10, 100])
def test_ddp_over_more_nodes_on_a_slower_link_is_never_faster(gbit):
    work, inter = Workload(VIT_B), Link.of(gbit, 50)
    plan = TimedPlan("ddp", 8, 32)
    one_node = step_cost(plan, work, cluster(1, 8, inter=inter)).step_s
    for nodes in (2, 4, 8):
        spread = cluster(nodes, 8 // nodes, inter=inter)
        assert step_cost(plan, work, spread).step_s >= one_node
    assert step_cost(plan, work, cluster(2, 4, inter=inter)).comm_s > 0


def test_hsdp_crosses_a_slow_link_less_than_fsdp():
    """On 2 nodes x 8 joined at 10 Gbit/s, HSDP's one all-reduce of shards
    across nodes costs less than FSDP's gathers and reductions over all 16."""
    work, two_nodes = Workload(VIT_B), cluster(2, 8, inter=Link.of(10, 20))
    fsdp = step_cost(TimedPlan("fsdp", 16, 32), work, two_nodes)
    hsdp = step_cost(TimedPlan("hsdp", 16, 32, shard_size=8), work, two_nodes)
    assert hsdp.comm_s < fsdp.comm_s


def test_collectives_are_counted_one_by_one():
    """ZeRO-1 broadcasts each rank's bucket of parameters: with a latency of
    2 ms and an endless bandwidth, its step on 2 ranks is DDP's plus 2 x 2 ms,
    whatever the number of parameter tensors."""
    link, work = Link(2e-3, float("inf")), Workload(VIT_B)
    two = cluster(1, 2, intra=link)
    ddp = step_cost(TimedPlan("ddp", 2, 32), work, two).step_s
    zero1 = step_cost(TimedPlan("zero1", 2, 32), work, two).step_s
    assert zero1 - ddp == pytest.approx(2 * 2e-3)


def test_sharded_optimizer_steps_pay_dtensor_dispatch_per_tensor():
    """FSDP steps a shard of each parameter, but each is a DTensor whose
    dispatch costs per tensor: 1 ms a tensor on top of half the step."""
    free = cluster(1, 2, intra=Link(0.0, float("inf")))
    work = Workload(VIT_B, optimizer_s=0.2, sharded_tensor_s=1e-3)
    plain = step_cost(TimedPlan("ddp", 1, 32), work, free)
    fsdp = step_cost(TimedPlan("fsdp", 2, 32), work, free)
    expected = -0.2 / 2 + VIT_B.parameter_tensors * 1e-3
    assert fsdp.step_s - plain.step_s == pytest.approx(expected)


def test_fsdp_pays_its_machinery_around_each_gather_and_reduction():
    """On an endless, latency-free link, FSDP's passes still cost its own
    work around each collective: ViT-B's 12 blocks and its root are each
    gathered for the forward and (the blocks) again for the backward, and
    each reduced once: 12 x 2 + 1 + 13 = 38 collectives a micro-batch of 1
    ms each, 25 per further micro-batch (gradients reduce on the last)."""
    free = cluster(1, 2, intra=Link(0.0, float("inf")))
    work = Workload(VIT_B, sharded_collective_s=1e-3)
    bare = Workload(VIT_B)
    for accum, collectives in ((1, 38), (2, 38 + 25)):
        plan = TimedPlan("fsdp", 2, 32, accum_steps=accum)
        extra = step_cost(plan, work, free).step_s - step_cost(plan, bare, free).step_s
        assert extra == pytest.approx(collectives * 1e-3)
    ddp = TimedPlan("ddp", 2, 32)
    assert step_cost(ddp, work, free).step_s == step_cost(ddp, bare, free).step_s


def test_reduce_scatters_cost_what_the_link_measured_of_them():
    """gloo's reduce-scatters reach a share of its all-reduces' bandwidth
    (measured): at half of it, FSDP's gradient reductions take twice as
    long on the wire, its gathers are unchanged."""
    even, slow = Link(0.0, 1e9), Link(0.0, 1e9, scatter_share=0.5)
    plan = TimedPlan("fsdp", 2, 32)
    work = Workload(VIT_B)
    base = step_cost(plan, work, cluster(1, 2, intra=even)).comm_s
    halved = step_cost(plan, work, cluster(1, 2, intra=slow)).comm_s
    reductions = VIT_B.parameters * 4 / 2 / 1e9  # (n - 1) / n of the gradients
    assert halved - base == pytest.approx(reductions)


def test_an_unknown_strategy_is_refused():
    with pytest.raises(ValueError, match="no cost model for strategy 'dp'"):
        step_cost(TimedPlan("dp", 2, 32), Workload(VIT_B), cluster())


# --------------------------------------------------------------------------- #
# The datasheet table
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize(
    "name,expected",
    [
        ("NVIDIA A100-SXM4-40GB", "A100 SXM 40GB"),
        ("NVIDIA A100-SXM4-80GB", "A100 SXM 80GB"),
        ("NVIDIA A100-PCIE-40GB", "A100 PCIe 40GB"),
        ("NVIDIA A100 80GB PCIe", "A100 PCIe 80GB"),
        ("A100", "A100 SXM 40GB"),
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA H200", "H200 SXM"),
        ("NVIDIA H200 NVL", "H200 NVL"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA A10", "A10"),
        ("NVIDIA A10G", None),
        ("NVIDIA GeForce RTX 4090", None),
        ("cpu", None),
    ],
)
def test_devices_are_found_by_the_names_cuda_and_users_give(name, expected):
    sheet = find_device(name)
    assert (sheet.name if sheet else None) == expected


def test_the_peaks_are_dense_never_sparse():
    """NVIDIA prints H100 SXM bf16 as 1,979 TFLOP/s with sparsity; dense is
    half of it (Lightning#20660 counted the sparse one)."""
    h100 = find_device("NVIDIA H100 80GB HBM3")
    assert h100.peak_flops("bf16") == pytest.approx(989.5e12)
    assert h100.peak_flops("fp16") == h100.peak_flops("bf16")
    assert h100.peak_flops("tf32") == pytest.approx(494.5e12)
    assert h100.peak_flops("fp32") == pytest.approx(67e12)
    a100 = find_device("NVIDIA A100-SXM4-80GB")
    assert (a100.peak_flops("bf16"), a100.peak_flops("tf32")) == (312e12, 156e12)
    assert find_device("NVIDIA L40S").peak_flops("bf16") == pytest.approx(362.05e12)
    with pytest.raises(ValueError, match="precision 'fp8'"):
        h100.peak_flops("fp8")


@pytest.fixture
def tf32_restored():
    """torch's TF32 switches, put back as they were after the test."""
    saved = torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision()
    yield
    torch.backends.cudnn.allow_tf32 = saved[0]
    torch.set_float32_matmul_precision(saved[1])


def test_the_peak_follows_the_runs_precision(tf32_restored):
    """bf16 under autocast; in full precision TF32 where the run allows it:
    cuDNN's convolutions by default, matrix products only when asked."""
    a100 = find_device("A100")
    assert dense_peak_flops(a100, torch.bfloat16, 0.5) == 312e12
    torch.backends.cudnn.allow_tf32 = True
    torch.set_float32_matmul_precision("highest")
    assert dense_peak_flops(a100, None, 1.0) == 156e12  # a CNN
    assert dense_peak_flops(a100, None, 0.0) == 19.5e12  # a ViT
    mixed = dense_peak_flops(a100, None, 0.5)
    assert mixed == pytest.approx(1 / (0.5 / 156e12 + 0.5 / 19.5e12))
    torch.set_float32_matmul_precision("high")
    assert dense_peak_flops(a100, None, 0.0) == 156e12
    torch.backends.cudnn.allow_tf32 = False
    assert dense_peak_flops(a100, None, 1.0) == 19.5e12


# --------------------------------------------------------------------------- #
# FLOPs, TFLOP/s and MFU
# --------------------------------------------------------------------------- #
def vit_tiny_flops(tokens=65, width=192, mlp=768, depth=6, classes=10) -> float:
    """vit_tiny_patch4's forward and backward FLOPs per image at 32 px, by
    hand: per block q, k, v, out and the MLP's two layers (2 FLOPs per
    multiply-add), and attention's two products; the patch embedding (a
    4x4 convolution over 64 patches) and the head.  Backward is twice the
    forward, but the patch embedding computes no gradient for its input."""
    block = 2 * tokens * (4 * width**2 + 2 * width * mlp) + 4 * tokens**2 * width
    patches = 2 * (tokens - 1) * 3 * 4 * 4 * width
    head = 2 * width * classes
    forward = depth * block + patches + head
    return forward + 2 * (forward - patches) + patches


def test_vit_tiny_costs_its_analytic_flops():
    counted = count_flops(functools.partial(build_model, "vit_tiny_patch4", 10), 32)
    assert counted.per_image == vit_tiny_flops()  # 1.0959 GFLOP
    assert len(counted.blocks) == 6 and counted.parameters == 2_681_098
    assert counted.conv_share < 0.01


def run_tiny(out_dir, monkeypatch, peak=None) -> list[dict]:
    if peak:
        monkeypatch.setattr(plan_flops, "device_peak", lambda *a: (peak, "calibrated"))
    result = call_main(*TINY, "OUT_DIR", str(out_dir))
    assert result.returncode == 0, result.stderr
    return read_metrics(str(out_dir), "train")


def test_a_run_logs_its_tflops_and_mfu_only_with_a_known_peak(tmp_path, monkeypatch):
    """On a CPU nobody calibrated, the windows show TFLOP/s and no MFU; with
    a peak (as ``DIST.STRATEGY auto`` calibrates one) the MFU is TFLOP/s
    over it."""
    plain = run_tiny(tmp_path / "plain", monkeypatch)
    assert all(r["tflops_per_device"] > 0 and "mfu" not in r for r in plain)
    calibrated = run_tiny(tmp_path / "calibrated", monkeypatch, peak=1e12)
    assert all(r["mfu"] == pytest.approx(r["tflops_per_device"]) for r in calibrated)
    events = event_accumulator.EventAccumulator(str(tmp_path / "calibrated" / "tb"))
    events.Reload()
    shown = [event.value for event in events.Scalars("train/mfu")]
    assert shown == pytest.approx([r["mfu"] for r in calibrated])


def test_the_flop_rate_follows_the_progressive_crop():
    """Under TRAIN.PROGRESSIVE an epoch at 16 px does a quarter of the FLOPs
    of one at 32 px (resnet8 is all convolutions and pooling): the same
    images in the same seconds show a quarter of the TFLOP/s.  Each crop is
    counted once."""
    meter = FlopMeter(
        types.SimpleNamespace(arch="resnet8", num_classes=10),
        32,
        [torch.device("cpu")],
        None,
        crop_of=lambda epoch: (16, 32)[epoch],
    )
    small, large = (meter.of_window(64, 1.0, epoch) for epoch in (0, 1))
    assert small["tflops_per_device"] == pytest.approx(
        large["tflops_per_device"] / 4, rel=0.02
    )
    assert sorted(meter.rates) == [16, 32]


def test_a_compressing_hook_shortens_ddps_exposed_all_reduce_across_nodes():
    """DIST.DDP.COMM_HOOK: fp16's half of the bytes, and PowerSGD's factors,
    cost less on the wire between nodes; the compute is the same."""
    slow = cluster(nodes=2, per_node=1, inter=Link.of(0.1, 20), overlap=False)
    ddp = TimedPlan("ddp", 2, micro_batch=32, accum_steps=1)
    costs = {
        share: step_cost(ddp, Workload(VIT_B, gradient_share=share), slow)
        for share in (1.0, 0.5, 0.05)
    }
    assert costs[0.5].compute_s == costs[1.0].compute_s
    assert costs[0.5].comm_s == pytest.approx(costs[1.0].comm_s / 2, rel=0.01)
    assert costs[0.05].comm_s < costs[0.5].comm_s / 5
