"""ZeRO-1's bucket views in one process: a weight that torch's
``parameters_as_bucket_view`` flattened into its buffer gets its layout back
(tests/strategies/test_parallel.py trains with them on 2 ranks)."""

from __future__ import annotations

import torch
from torch import nn

from distribuuuu.strategies.zero1 import fit_one_bucket, is_dense, restore_strides


def test_a_channels_last_weight_gets_its_strides_back_in_its_slot():
    """As torch builds a bucket: the weight copied in logical order into the
    second slot of a flat buffer and viewed contiguous there.  Restored, it
    is channels-last again, holds the same values and still lives in that
    slot, so what a broadcast writes into the buffer reaches it."""
    weight = nn.Parameter(torch.randn(4, 3, 2, 2).to(memory_format=torch.channels_last))
    values, stride, n = weight.detach().clone(), weight.stride(), weight.numel()
    bucket = torch.zeros(2 * n)
    bucket[n:].copy_(weight.data.flatten())
    weight.data = bucket[n:].view_as(weight.data)
    assert weight.is_contiguous() and weight.stride() != stride
    assert restore_strides([(weight, stride)]) == 1
    assert weight.stride() == stride and torch.equal(weight, values)
    assert weight.data_ptr() == bucket[n:].data_ptr()
    bucket[n:] = torch.arange(n, dtype=bucket.dtype)  # as a broadcast writes
    in_memory_order = weight.detach().permute(0, 2, 3, 1).flatten()  # NHWC
    assert torch.equal(in_memory_order, bucket[n:])
    assert restore_strides([(weight, stride)]) == 0  # already laid out


def test_only_dense_layouts_of_one_dtype_are_bucketed_or_restored():
    image = torch.empty(2, 3, 4, 5)
    assert is_dense(image.shape, image.stride())
    channels_last = image.to(memory_format=torch.channels_last)
    assert is_dense(channels_last.shape, channels_last.stride())
    every_other = torch.empty(2, 6)[:, ::2]
    assert not is_dense(every_other.shape, every_other.stride())
    overlapping = torch.empty(3).expand(4, 3)
    assert not is_dense(overlapping.shape, overlapping.stride())
    assert fit_one_bucket([torch.empty(3), image])
    assert not fit_one_bucket([torch.empty(3), torch.empty(3, dtype=torch.bfloat16)])
