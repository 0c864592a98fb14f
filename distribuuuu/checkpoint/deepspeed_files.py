"""DeepSpeed's checkpoint folder beside one of ours, read without running code.

DeepSpeed loads its files with ``torch.load(weights_only=False)``
(``TorchCheckpointEngine.load`` in DeepSpeed 0.19), which would run whatever a
crafted file pickles.  Before DeepSpeed reads a folder, the pickle of every
file in it is walked by an unpickler that knows the exact ``(module, name)``
pairs DeepSpeed's files hold (measured on the files of ZeRO stages 1-3, with
offload) and refuses any other; nothing it builds is kept, and DeepSpeed
need not even be installed to check.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import zipfile
from collections import OrderedDict
from typing import Any

import torch

from distribuuuu.checkpoint.files import DEEPSPEED_SUFFIX, DEEPSPEED_TAG, refused
from distribuuuu.state import deepspeed_folder_name

# The files DeepSpeed writes into a checkpoint's tag folder.
_DEEPSPEED_FILE = re.compile(
    r"^(bf16_)?(zero_pp_rank_\d+_)?mp_rank_\d+_(model|optim)_states\.pt$"
)
# The largest pickle part of one file (the tensors are stored beside it).
_MAX_PICKLE_BYTES = 64 << 20

# Globals built as themselves: plain containers, sizes and dtypes.
_REAL = {("collections", "OrderedDict"): OrderedDict, ("torch", "Size"): torch.Size}
_REAL |= {("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)}
# Globals only named (torch's tensor rebuilding, DeepSpeed's small classes):
# stood in for by a stub, since the objects are never used.
_NAMED = {
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"),
    ("torch._tensor", "_rebuild_from_type_v2"),
    ("torch", "Tensor"),
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
} | {("torch", n) for n in dir(torch) if n.endswith("Storage")}


class _Stub:
    """Stands in for a named global: takes any arguments and state."""

    def __new__(cls, *args: Any, **kwargs: Any):
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any):
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Stub:
        return _Stub()

    def __setstate__(self, state: Any) -> None:
        pass


class _ForbiddenGlobalError(pickle.UnpicklingError):
    pass


class _DeepSpeedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _REAL:
            return _REAL[(module, name)]
        if (module, name) in _NAMED:
            return _Stub
        raise _ForbiddenGlobalError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> None:
        return None  # a tensor's storage: not read


def deepspeed_folder(path: str, state: dict) -> str:
    """The DeepSpeed folder that checkpoint ``path`` (``state``) names, beside it."""
    from distribuuuu.checkpoint.shards import folder_beside  # imports DCP

    return folder_beside(path, deepspeed_folder_name(state), DEEPSPEED_SUFFIX)


def _pickle_of(path: str) -> bytes:
    with zipfile.ZipFile(path) as archive:
        names = [n for n in archive.namelist() if n.endswith("/data.pkl")]
        if len(names) != 1:
            raise refused(f"{path} is not a file torch.save wrote")
        if archive.getinfo(names[0]).file_size > _MAX_PICKLE_BYTES:
            raise refused(f"{path}: its pickle is over {_MAX_PICKLE_BYTES >> 20} MiB")
        return archive.read(names[0])


def check_deepspeed_files(folder: str) -> None:
    """Refuse (RefusedCheckpointError) a DeepSpeed checkpoint folder whose tag
    folder holds a file DeepSpeed does not write, or one that pickles code or
    other objects."""
    directory = os.path.join(folder, DEEPSPEED_TAG)
    if not os.path.isdir(directory) or os.path.islink(directory):
        raise refused(f"{folder}: no {DEEPSPEED_TAG} folder of DeepSpeed's files")
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if not _DEEPSPEED_FILE.match(name) or not os.path.isfile(path):
            raise refused(f"{directory}: {name} is not a file DeepSpeed writes")
        try:
            _DeepSpeedUnpickler(io.BytesIO(_pickle_of(path))).load()
        except _ForbiddenGlobalError as error:
            raise refused(
                f"{path} holds pickled code or objects ({error}), which are never "
                "loaded"
            ) from None
        except Exception as error:  # noqa: BLE001 - whatever a crafted file does
            raise refused(f"{path} is not a file torch.save wrote ({error})") from None
