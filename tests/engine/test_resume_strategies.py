"""Nothing lost under the strategies that save pieces: a pipeline, tensor-
parallel ranks and DeepSpeed's ZeRO, each SIGKILLed mid-run, rerun to end
bitwise where an uninterrupted run ends (the run: helpers.KILLED_RUN)."""

from __future__ import annotations

import pytest
from helpers import sigkill_then_rerun_matches_uninterrupted


@pytest.mark.distributed
@pytest.mark.slow
def test_sigkill_a_pipeline_then_rerun_is_bitwise_identical(tmp_path):
    """Each of the 2 stages saves its piece; the rerun reads them back."""
    pipeline = ("DIST.STRATEGY", "pipeline", "MODEL.EMA", "True")
    sigkill_then_rerun_matches_uninterrupted(tmp_path, 2, False, pipeline)


@pytest.mark.distributed
@pytest.mark.slow
def test_sigkill_tensor_parallel_ranks_then_rerun_is_bitwise_identical(tmp_path):
    """vit_tiny_patch4 split over 2 ranks; its DCP shards read back.  At 16 px
    (16 patches) a step costs a third of one at 28 px."""
    tensor = ("MODEL.ARCH", "vit_tiny_patch4", "DIST.TENSOR_PARALLEL", "2")
    tensor += ("TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16")
    sigkill_then_rerun_matches_uninterrupted(tmp_path, 2, False, tensor)


@pytest.mark.distributed
@pytest.mark.slow
def test_sigkill_deepspeed_ranks_then_rerun_is_bitwise_identical(tmp_path):
    """ZeRO-2 with an EMA: DeepSpeed's files of the same layout read back.
    2 ranks of 64: 4,096 images make 32 steps."""
    pytest.importorskip("deepspeed")
    deepspeed = ("DIST.STRATEGY", "deepspeed", "MODEL.EMA", "True")
    deepspeed += ("DATA.SYNTHETIC_SIZE", "[4096,200]")
    sigkill_then_rerun_matches_uninterrupted(tmp_path, 2, False, deepspeed)
