"""Optimizer states keyed by parameter index (as torch, DDP and ZeRO save
them) or by parameter name (as FSDP and the pipeline's stages do), and the
renaming between the two, so that a checkpoint of one strategy resumes under
another."""

from __future__ import annotations

import torch
from torch import nn

from distribuuuu.models.wrappers import unwrap_model


def rekey_optimizer_state(state: dict, old: list, new: list) -> dict:
    """An optimizer state_dict with its parameter keys ``old`` renamed ``new``."""
    rename = dict(zip(old, new))
    groups = [
        {**group, "params": [rename[key] for key in group["params"]]}
        for group in state["param_groups"]
    ]
    states = {rename[key]: value for key, value in state["state"].items()}
    return {"state": states, "param_groups": groups}


def parameter_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of ``optimizer``'s parameters in its order (groups flattened)."""
    owner = {param: name for name, param in unwrap_model(model).named_parameters()}
    return [owner[p] for group in optimizer.param_groups for p in group["params"]]


def own_groups_by_name(
    state: dict, model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict:
    """An optimizer state keyed by parameter name, cut and ordered to
    ``optimizer``'s own groups (each with the saved hyper-parameters of its
    first parameter): torch's ``load_state_dict`` pairs saved and current
    parameters by position, so the saved order must be the optimizer's."""
    saved_group = {n: g for g in state["param_groups"] for n in g["params"]}
    names = iter(parameter_names(model, optimizer))
    groups = []
    for group in optimizer.param_groups:
        own = [next(names) for _ in group["params"]]
        groups.append({**saved_group[own[0]], "params": own})
    saved = state["state"]
    states = {n: saved[n] for g in groups for n in g["params"] if n in saved}
    return {"state": states, "param_groups": groups}


def keyed_by_name(state: dict) -> bool:
    """Whether an optimizer state_dict keys its parameters by name (FSDP's)."""
    saved = [key for group in state["param_groups"] for key in group["params"]]
    return any(isinstance(key, str) for key in saved)
