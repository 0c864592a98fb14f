"""The devices the planner knows on paper: dense peak FLOP/s and memory from
NVIDIA's datasheets, looked up by the name CUDA reports or a user types.

Every peak is the *dense* one.  NVIDIA's datasheets print the tensor-core
figures of Ampere, Ada and Hopper with 2:4 structured sparsity, marked with an
asterisk whose footnote says the dense figure is one half; a dense model's
FLOPs measured against a sparse peak read as half the MFU they are
(Lightning#20660).  The table keeps the dense halves.  fp16 and bf16 tensor
peaks are equal on all of these devices.  Memory is the datasheet's capacity
(GB as printed); a live run reads its device's own.

Sources (the datasheets and product pages, each with its footnote
"* With sparsity"):

- A100: NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-
  nvidia-1758950-r4), https://www.nvidia.com/en-us/data-center/a100/ :
  FP32 19.5, TF32 156 | 312*, BF16 312 | 624* TFLOPS; 40 GB HBM2 or 80 GB
  HBM2e; NVLink 600 GB/s (SXM); PCIe Gen4 64 GB/s.
- H100: NVIDIA H100 Tensor Core GPU datasheet,
  https://www.nvidia.com/en-us/data-center/h100/ : SXM FP32 67, TF32 989*,
  BF16 1,979*; PCIe FP32 51, TF32 756*, BF16 1,513*; NVL FP32 60, TF32 835*,
  BF16 1,671*; 80 GB (SXM, PCIe), 94 GB (NVL); NVLink 900 GB/s (SXM), PCIe
  Gen5 128 GB/s.
- H200: NVIDIA H200 Tensor Core GPU datasheet,
  https://www.nvidia.com/en-us/data-center/h200/ : SXM as the H100 SXM (FP32
  67, TF32 989*, BF16 1,979*), NVL as the H100 NVL (60, 835*, 1,671*);
  141 GB HBM3e; NVLink 900 GB/s.
- L40S: NVIDIA L40S datasheet, https://www.nvidia.com/en-us/data-center/l40s/ :
  FP32 91.6, TF32 183 | 366*, BF16 362.05 | 733*; 48 GB GDDR6; PCIe Gen4 x16
  64 GB/s.
- A10: NVIDIA A10 Tensor Core GPU datasheet,
  https://www.nvidia.com/en-us/data-center/products/a10-gpu/ : FP32 31.2,
  TF32 62.5 | 125*, BF16 125 | 250*; 24 GB GDDR6; PCIe Gen4 64 GB/s.

Interconnect figures (NVLink, PCIe to the host) are the datasheets'
bidirectional totals.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

TERA = 1e12
PRECISIONS = ("bf16", "fp16", "tf32", "fp32")


@dataclass(frozen=True)
class DeviceSheet:
    """One device's datasheet figures (dense TFLOP/s, GB, GB/s)."""

    name: str  # how the planner names it
    model: str  # the model token of its name: a100, h100, ...
    form: str  # sxm | pcie | nvl
    memory_gb: float  # capacity as printed
    fp32_tflops: float  # without tensor cores
    tf32_tflops: float  # dense tensor-core TF32
    bf16_tflops: float  # dense tensor-core bf16 (fp16 is the same)
    # Between the GPUs of a node, bidirectional: NVLink on SXM boards; PCIe on
    # PCIe and NVL boards, whose NVLink bridges join only pairs (H200 NVL: up
    # to 4), so that a ring over a node's 8 GPUs crosses PCIe.
    link_gb_s: float
    host_gb_s: float  # PCIe to the host, bidirectional
    default: bool = False  # the one a bare model name means

    def peak_flops(self, precision: str) -> float:
        """Dense peak FLOP/s in ``precision`` (bf16, fp16, tf32 or fp32)."""
        if precision not in PRECISIONS:
            raise ValueError(f"precision {precision!r}: one of {PRECISIONS}")
        tflops = {
            "bf16": self.bf16_tflops,
            "fp16": self.bf16_tflops,
            "tf32": self.tf32_tflops,
            "fp32": self.fp32_tflops,
        }[precision]
        return tflops * TERA


# Dense figures: the datasheets' sparse ones (marked *) halved, as their
# footnotes say: H100 SXM's TF32 989* and BF16 1,979* are 494.5 and 989.5
# (see the module's docstring for each source).
DEVICES = (
    DeviceSheet("A100 SXM 40GB", "a100", "sxm", 40, 19.5, 156, 312, 600, 64, True),
    DeviceSheet("A100 SXM 80GB", "a100", "sxm", 80, 19.5, 156, 312, 600, 64),
    DeviceSheet("A100 PCIe 40GB", "a100", "pcie", 40, 19.5, 156, 312, 64, 64),
    DeviceSheet("A100 PCIe 80GB", "a100", "pcie", 80, 19.5, 156, 312, 64, 64),
    DeviceSheet("H100 SXM", "h100", "sxm", 80, 67, 494.5, 989.5, 900, 128, True),
    DeviceSheet("H100 PCIe", "h100", "pcie", 80, 51, 378, 756.5, 128, 128),
    DeviceSheet("H100 NVL", "h100", "nvl", 94, 60, 417.5, 835.5, 128, 128),
    DeviceSheet("H200 SXM", "h200", "sxm", 141, 67, 494.5, 989.5, 900, 128, True),
    DeviceSheet("H200 NVL", "h200", "nvl", 141, 60, 417.5, 835.5, 128, 128),
    DeviceSheet("L40S", "l40s", "pcie", 48, 91.6, 183, 362.05, 64, 64, True),
    DeviceSheet("A10", "a10", "pcie", 24, 31.2, 62.5, 125, 64, 64, True),
)
FORMS = ("sxm", "pcie", "nvl")


def _tokens(name: str) -> list[str]:
    """``"NVIDIA A100-SXM4-40GB"`` -> ``["a100", "sxm", "40gb"]``."""
    words = re.split(r"[\s_\-/]+", name.lower())
    words = [re.sub(r"^(sxm|pcie)\d*$", r"\1", word) for word in words if word]
    return [word for word in words if word not in ("nvidia", "tesla")]


def find_device(name: str) -> DeviceSheet | None:
    """The datasheet of the device ``name`` names, or None for one not in the
    table (a CPU, an A10G, a consumer GPU).

    ``name`` is what ``torch.cuda.get_device_name()`` returns ("NVIDIA
    A100-SXM4-80GB", "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe") or what a
    user types ("NVIDIA H100", "h100 pcie", "A100 80GB").  A name without a
    form factor means the SXM board (CUDA names the H100 SXM "NVIDIA H100
    80GB HBM3"); a name without a capacity means the smaller one (an A100
    alone is the 40 GB board: a plan that fits it fits the other).
    """
    words = _tokens(name)
    models = {sheet.model for sheet in DEVICES}
    model = next((word for word in words if word in models), None)
    if model is None:
        return None
    found = [sheet for sheet in DEVICES if sheet.model == model]
    form = next((word for word in words if word in FORMS), None)
    if form is not None:
        found = [sheet for sheet in found if sheet.form == form]
    sizes = [float(word[:-2]) for word in words if re.fullmatch(r"\d+gb", word)]
    if sizes:
        found = [sheet for sheet in found if sheet.memory_gb == sizes[0]]
    if len(found) > 1:
        found = [sheet for sheet in found if sheet.default] or found[:1]
    return found[0] if found else None


def run_precisions(amp_dtype: torch.dtype | None) -> tuple[str, str]:
    """The precisions a CUDA run computes in: (convolutions, matrix products).

    Under autocast both run in its dtype.  In full precision, PyTorch runs
    convolutions in TF32 by default (``torch.backends.cudnn.allow_tf32``)
    and matrix products in FP32 unless the run allows TF32
    (``torch.backends.cuda.matmul.allow_tf32``, or a float32 matmul
    precision other than "highest").
    """
    if amp_dtype is not None:
        name = "bf16" if amp_dtype == torch.bfloat16 else "fp16"
        return name, name
    conv = "tf32" if torch.backends.cudnn.allow_tf32 else "fp32"
    matmul_tf32 = torch.backends.cuda.matmul.allow_tf32 or (
        torch.get_float32_matmul_precision() != "highest"
    )
    return conv, "tf32" if matmul_tf32 else "fp32"


def dense_peak_flops(
    sheet: DeviceSheet, amp_dtype: torch.dtype | None, conv_share: float
) -> float:
    """The dense peak FLOP/s of ``sheet`` for a model whose FLOPs are
    ``conv_share`` convolutions and the rest matrix products, in the run's
    precisions (:func:`run_precisions`): the time-weighted (harmonic) mix of
    the two peaks, which is either peak alone when they agree."""
    conv, matmul = run_precisions(amp_dtype)
    seconds = conv_share / sheet.peak_flops(conv)
    seconds += (1 - conv_share) / sheet.peak_flops(matmul)
    return 1 / seconds


def describe_precision(amp_dtype: torch.dtype | None, conv_share: float) -> str:
    """The precision of the peak in words: "bf16", "tf32", "tf32 conv / fp32
    matmul"."""
    conv, matmul = run_precisions(amp_dtype)
    if conv == matmul or conv_share >= 1:
        return conv
    if conv_share <= 0:
        return matmul
    return f"{conv} conv / {matmul} matmul"


def device_peak(
    device: torch.device,
    amp_dtype: torch.dtype | None,
    conv_share: float,
    calibrated: float | None = None,
) -> tuple[float | None, str]:
    """The dense peak FLOP/s of one of the run's devices, and its source in
    words: ``calibrated`` where one was measured (``DIST.STRATEGY auto``,
    ``tools/plan.py``), else the datasheet of a CUDA device in the table;
    (None, "") for a CPU that was not calibrated or a device not in it."""
    if calibrated:
        return calibrated, "calibrated on this device"
    if device.type != "cuda":
        return None, ""
    sheet = find_device(torch.cuda.get_device_name(device))
    if sheet is None:
        return None, ""
    precision = describe_precision(amp_dtype, conv_share)
    return dense_peak_flops(sheet, amp_dtype, conv_share), f"{sheet.name} {precision}"
