"""DIST.DDP.COMM_HOOK: how DDP sends its gradients, with torch's own hooks.

``fp16`` and ``bf16`` cast each bucket of gradients to half precision for the
all-reduce (``default_hooks.fp16_compress_hook``, ``bf16_compress_hook``).
``powersgd`` sends each gradient matrix as a low-rank factorization with error
feedback (``powerSGD_hook.powerSGD_hook``, Vogels et al., NeurIPS 2019): what
the factorization misses is added to the next step's gradient.

PowerSGD keeps state per DDP bucket: each rank's error, and the factors P and
Q that the next step starts from (torch's warm start).  DDP rearranges its
buckets after the first iteration of every new model (in the order the
gradients became ready), so a resumed run's first step meets other buckets
than the step that saved.  :class:`PowerSGD` therefore keeps the state per
parameter across bucket layouts: it takes torch's tensors of a bucket apart
when the layout changes (and, without changing them, when saving), and puts
a bucket's pieces together when the bucket first comes by.  The error is
elementwise and each matrix is compressed alone (torch's default), so the
numbers do not depend on the bucket they travel in.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    PowerSGDState,
    powerSGD_hook,
)
from torch.nn.parallel import DistributedDataParallel

from distribuuuu.strategies.spec import CommHookSpec

logger = logging.getLogger(__name__)

_CASTS = {
    "fp16": default_hooks.fp16_compress_hook,
    "bf16": default_hooks.bf16_compress_hook,
}
# The state kept per parameter: the error feedback, the factors P and Q.
_KINDS = ("error", "p", "q")
_MT19937_KEYS = 624  # the words of NumPy's Mersenne Twister state
# torch's PowerSGDState default: a matrix is compressed when that divides its
# size by more than this.
_MIN_COMPRESSION_RATE = 2


def register(model: DistributedDataParallel, spec: CommHookSpec) -> PowerSGD | None:
    """Give ``model`` the hook ``spec`` names; the PowerSGD state to save, if
    that is the hook."""
    if spec.name == "none":
        return None
    if spec.name in _CASTS:
        model.register_comm_hook(None, _CASTS[spec.name])
        logger.info("DDP sends its gradients as %s", spec.name)
        return None
    if spec.name != "powersgd":
        raise ValueError(f"unknown DDP communication hook {spec.name!r}")
    hook = PowerSGD(model.module, spec.powersgd_rank, spec.powersgd_start_iter)
    model.register_comm_hook(hook.state, hook.communicate)
    logger.info(
        "DDP sends its gradients compressed by PowerSGD (rank %d) from step %d",
        spec.powersgd_rank,
        spec.powersgd_start_iter,
    )
    return hook


def compressed_share(spec: CommHookSpec, shapes: Iterable[tuple[int, ...]]) -> float:
    """What DDP's all-reduces carry under ``spec``'s hook, as a share of the
    float32 gradients of parameters of ``shapes`` (PowerSGD's factors once
    it compresses, the other tensors whole)."""
    if spec.name == "none":
        return 1.0
    if spec.name in _CASTS:
        return 0.5
    sent = total = 0
    for shape in shapes:
        size = math.prod(shape)
        total += size
        factors = _factor_sizes(shape, spec.powersgd_rank, _MIN_COMPRESSION_RATE)
        sent += size if factors is None else sum(factors)
    return sent / max(total, 1)


def _factor_sizes(
    shape: tuple[int, ...], rank: int, min_rate: float
) -> tuple[int, int] | None:
    """The sizes of P and Q that torch's hook makes for a gradient of
    ``shape`` (seen as rows x the rest), or None where it sends it whole."""
    rows = shape[0] if shape else 1
    cols = math.prod(shape) // max(rows, 1)
    low = min(rows, cols, rank)
    if (rows + cols) * low * min_rate < rows * cols:
        return rows * low, cols * low
    return None


class PowerSGD:
    """torch's layer-wise PowerSGD hook, with its state kept per parameter
    (see the module's docstring) so that it survives DDP's new buckets and a
    resume.  DDP calls :meth:`communicate` with each bucket, in index order."""

    def __init__(self, module: nn.Module, rank: int, start_iter: int):
        self.state = PowerSGDState(
            process_group=None,
            matrix_approximation_rank=rank,
            start_powerSGD_iter=start_iter,
            min_compression_rate=_MIN_COMPRESSION_RATE,
        )
        self.names = {id(param): name for name, param in module.named_parameters()}
        # Bucket index -> its parameters' names and shapes, as last seen.
        self.layout: dict[int, list[tuple[str, tuple[int, ...]]]] = {}
        # Kind -> parameter name -> its piece, while in no torch bucket.
        self.pieces: dict[str, dict[str, torch.Tensor]] = {kind: {} for kind in _KINDS}

    # What DDP calls. Not annotated: DDP compares the annotations with its
    # classes, and this module's are strings (``from __future__``).
    def communicate(self, state, bucket):  # noqa: ANN001
        index = bucket.index()
        params = [(self.names[id(p)], tuple(p.shape)) for p in bucket.parameters()]
        if self.layout.get(index) != params:
            # DDP reduces its buckets in index order: those from this one on
            # have not run in this iteration, and hold the old layout's state.
            for old in [each for each in self.layout if each >= index]:
                self._take_apart(old)
            self.layout[index] = params
            self._put_together(index, bucket.buffer())
        future = powerSGD_hook(state, bucket)
        if bucket.buffer().device.type != "cuda":
            # torch's hook issues its second and third all-reduce from the
            # first one's callback.  gloo runs callbacks on its own threads,
            # so the next bucket's first all-reduce could go ahead of them on
            # one rank and not on another: a mismatch that aborts the job.
            # One bucket at a time keeps every rank's order the same.  (NCCL's
            # futures run callbacks as they are issued, in order.)
            future.wait()
        return future

    # --- between torch's buckets and pieces per parameter ------------------ #
    def _sizes(self, index: int) -> dict[str, list[tuple[str, int]]]:
        """(parameter, size) of each kind of state of bucket ``index``, in the
        order of torch's flat tensors: the error follows the bucket; P and Q
        hold the compressed matrices grouped by shape (first seen first)."""
        params = self.layout[index]
        groups: dict[tuple[int, ...], list[tuple[str, int, int]]] = {}
        for name, shape in params:
            factors = _factor_sizes(
                shape,
                self.state.matrix_approximation_rank,
                self.state.min_compression_rate,
            )
            if factors is not None:
                rows = shape[0]
                groups.setdefault((rows, math.prod(shape) // rows), []).append(
                    (name, *factors)
                )
        matrices = [entry for group in groups.values() for entry in group]
        return {
            "error": [(name, math.prod(shape)) for name, shape in params],
            "p": [(name, p) for name, p, _ in matrices],
            "q": [(name, q) for name, _, q in matrices],
        }

    def _torch_tensors(self, index: int) -> dict[str, torch.Tensor]:
        state = self.state
        tensors = {
            "error": state.error_dict.get(index),
            "p": state.p_memory_dict.get(index),
            "q": state.q_memory_dict.get(index),
        }
        return {kind: tensor for kind, tensor in tensors.items() if tensor is not None}

    def _pieces_of(self, index: int) -> dict[str, dict[str, torch.Tensor]]:
        """Bucket ``index``'s state in torch's tensors, split per parameter
        (views of them)."""
        sizes, pieces = self._sizes(index), {}
        for kind, flat in self._torch_tensors(index).items():
            names = [name for name, _ in sizes[kind]]
            lengths = [length for _, length in sizes[kind]]
            if sum(lengths) != flat.numel():
                raise RuntimeError(
                    f"PowerSGD's {kind} tensor of DDP bucket {index} holds "
                    f"{flat.numel()} numbers, not the {sum(lengths)} of its "
                    f"parameters: torch {torch.__version__}'s powerSGD_hook lays "
                    "its state out otherwise than distribuuuu reads it"
                )
            pieces[kind] = dict(zip(names, flat.split(lengths)))
        return pieces

    def _take_apart(self, index: int) -> None:
        for kind, pieces in self._pieces_of(index).items():
            self.pieces[kind].update(pieces)
        for held in (
            self.state.error_dict,
            self.state.p_memory_dict,
            self.state.q_memory_dict,
        ):
            held.pop(index, None)
        del self.layout[index]

    def _put_together(self, index: int, buffer: torch.Tensor) -> None:
        """torch's tensors of bucket ``index`` (like its ``buffer``) from the
        pieces of its parameters: an error of zeros where a parameter has
        none; factors only where every matrix has its own (torch draws new
        ones otherwise)."""
        sizes, state = self._sizes(index), self.state
        errors = self.pieces["error"]
        if any(name in errors for name, _ in sizes["error"]):
            state.error_dict[index] = torch.cat(
                [
                    _fitting(errors.pop(name, None), size, buffer)
                    for name, size in sizes["error"]
                ]
            )
        if not sizes["p"] and state.iter >= state.start_powerSGD_iter:
            # No matrix: torch's empty factors, as it made them (a drawn seed).
            state.p_memory_dict[index] = buffer.new_empty(0)
            state.q_memory_dict[index] = buffer.new_empty(0)
            return
        factors = []
        for kind in ("p", "q"):
            held = self.pieces[kind]
            found = [held.pop(name, None) for name, _ in sizes[kind]]
            fitting = [
                piece.to(buffer)
                for piece, (_, size) in zip(found, sizes[kind])
                if piece is not None and piece.numel() == size
            ]
            if fitting and len(fitting) == len(found):
                factors.append(torch.cat(fitting))
        if len(factors) == 2:
            state.p_memory_dict[index], state.q_memory_dict[index] = factors

    # --- the checkpoint -------------------------------------------------- #
    def state_dict(self) -> dict[str, Any]:
        """This rank's state: the iteration, the generator that seeds new
        factors, and the error and factors per parameter (on the CPU)."""
        pieces = {kind: dict(held) for kind, held in self.pieces.items()}
        for index in self.layout:
            for kind, found in self._pieces_of(index).items():
                pieces[kind].update(found)
        _, keys, pos, has_gauss, cached = self.state.rng.get_state(legacy=True)
        return {
            "iter": int(self.state.iter),
            "rng": [
                torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                int(pos),
                int(has_gauss),
                float(cached),
            ],
            **{
                kind: {n: t.detach().to("cpu", copy=True) for n, t in held.items()}
                for kind, held in pieces.items()
            },
        }

    def load_state_dict(self, saved: Any, with_error: bool = True) -> None:
        """Take :meth:`state_dict`'s ``saved`` (read from a checkpoint, so
        checked); ``with_error`` False leaves the error feedback at zero (the
        state of a rank of another world size)."""
        iteration, rng, pieces = _checked(saved, set(self.names.values()))
        if not with_error:
            pieces["error"] = {}
        state = self.state
        state.iter = iteration
        keys, pos, has_gauss, cached = rng
        state.rng.set_state(("MT19937", keys, pos, has_gauss, cached))
        for held in (state.error_dict, state.p_memory_dict, state.q_memory_dict):
            held.clear()
        self.layout.clear()
        self.pieces = pieces


def _fitting(piece: torch.Tensor | None, size: int, like: torch.Tensor) -> torch.Tensor:
    if piece is None or piece.numel() != size:
        return like.new_zeros(size)
    return piece.to(like)


def _checked(saved: Any, names: set[str]) -> tuple[int, tuple, dict]:
    """The iteration, the generator's state and the pieces of a saved
    PowerSGD state; ValueError naming what is wrong with it."""

    def fail(what: str) -> ValueError:
        return ValueError(f"the checkpoint's PowerSGD state is damaged: {what}")

    if not isinstance(saved, dict):
        raise fail("not a dict")
    iteration = saved.get("iter")
    if not isinstance(iteration, int) or iteration < 0:
        raise fail(f"its iteration is {iteration!r}")
    rng = saved.get("rng")
    if not (isinstance(rng, list) and len(rng) == 4 and torch.is_tensor(rng[0])):
        raise fail("its random generator is not [keys, pos, has_gauss, cached]")
    keys = rng[0]
    if keys.shape != (_MT19937_KEYS,) or keys.min() < 0 or keys.max() >= 2**32:
        raise fail(f"its generator's keys are not {_MT19937_KEYS} 32-bit words")
    if not all(isinstance(value, int | float) for value in rng[1:]):
        raise fail("its generator's position is not a number")
    pos, has_gauss, cached = int(rng[1]), int(rng[2]), float(rng[3])
    if not 0 <= pos <= _MT19937_KEYS:
        raise fail(f"its generator's position is {pos}")
    pieces: dict[str, dict[str, torch.Tensor]] = {}
    for kind in _KINDS:
        held = saved.get(kind)
        if not isinstance(held, dict):
            raise fail(f"its {kind!r} entry is not a dict")
        for name, piece in held.items():
            if name not in names or not torch.is_tensor(piece) or piece.dim() != 1:
                raise fail(f"its {kind!r} entry {name!r} is not this model's")
        pieces[kind] = dict(held)
    generator = (keys.numpy().astype(np.uint32), pos, has_gauss, cached)
    return iteration, generator, pieces
