"""Nothing lost under the strategies that save pieces: a pipeline, tensor-
parallel ranks, DeepSpeed's ZeRO and PowerSGD's state, each SIGKILLed mid-run,
rerun to end bitwise where an uninterrupted run ends (the run:
helpers.KILLED_RUN, made shorter here)."""

from __future__ import annotations

import pytest
from helpers import KILLED_RUN, sigkill_then_rerun_matches_uninterrupted

# helpers.KILLED_RUN in 24 steps of global batch 64 (1,536 images on one
# replica), a checkpoint every 6: the kill comes after the second (step 12),
# with as many steps still to run as in the 32-step runs of 2 replicas there.
SHORT_RUN = [*KILLED_RUN, "DATA.SYNTHETIC_SIZE", "[1536,200]"]
SHORT_RUN += ["CHECKPOINT.PERIOD_ITERS", "6"]


def _sigkill_then_rerun_matches_uninterrupted(tmp_path, more: tuple[str, ...]):
    """helpers.sigkill_then_rerun_matches_uninterrupted on 2 ranks (no tear)
    for :data:`SHORT_RUN`, killed after its second checkpoint (step 12)."""
    sigkill_then_rerun_matches_uninterrupted(
        tmp_path, 2, False, more, SHORT_RUN, "ckpt_ep_0000_it_0012.pth"
    )


@pytest.mark.distributed
@pytest.mark.slow
def test_sigkill_a_pipeline_then_rerun_is_bitwise_identical(tmp_path):
    """Each of the 2 stages saves its piece; the rerun reads them back."""
    pipeline = ("DIST.STRATEGY", "pipeline", "MODEL.EMA", "True")
    _sigkill_then_rerun_matches_uninterrupted(tmp_path, pipeline)


@pytest.mark.distributed
@pytest.mark.slow
def test_sigkill_tensor_parallel_ranks_then_rerun_is_bitwise_identical(tmp_path):
    """vit_tiny_patch4 split over 2 ranks; its DCP shards read back.  At 8 px
    (4 patches) a step costs less than one at 16 px (16 patches), a third of
    one at 28 px: the split of the blocks is the same."""
    tensor = ("MODEL.ARCH", "vit_tiny_patch4", "DIST.TENSOR_PARALLEL", "2")
    tensor += ("TRAIN.IM_SIZE", "8", "TEST.IM_SIZE", "8")
    _sigkill_then_rerun_matches_uninterrupted(tmp_path, tensor)


@pytest.mark.distributed
@pytest.mark.slow
def test_sigkill_deepspeed_ranks_then_rerun_is_bitwise_identical(tmp_path):
    """ZeRO-2 with an EMA: DeepSpeed's files of the same layout read back.
    2 ranks of 64: 3,072 images make 24 steps."""
    pytest.importorskip("deepspeed")
    deepspeed = ("DIST.STRATEGY", "deepspeed", "MODEL.EMA", "True")
    deepspeed += ("DATA.SYNTHETIC_SIZE", "[3072,200]")
    _sigkill_then_rerun_matches_uninterrupted(tmp_path, deepspeed)


@pytest.mark.distributed
@pytest.mark.slow
def test_sigkill_powersgd_ranks_then_rerun_is_bitwise_identical(tmp_path):
    """DDP compressing with PowerSGD from step 2: each rank's error feedback
    and the factors are saved; the rerun's new DDP takes them back.  2 ranks
    of 64: 3,072 images make 24 steps."""
    hook = ("DIST.DDP.COMM_HOOK", "powersgd", "DIST.DDP.POWERSGD_START_ITER", "2")
    hook += ("DATA.SYNTHETIC_SIZE", "[3072,200]")
    _sigkill_then_rerun_matches_uninterrupted(tmp_path, hook)
