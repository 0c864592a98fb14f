"""What a run tells its user: the start-up report and per-class results.

Text for the log, CSV files and a confusion-matrix image (drawn with Pillow,
which torchvision already needs) for tensorboard and ``--eval-only``.
"""

from __future__ import annotations

import csv
import os
import platform
import socket

import numpy as np
import torch
import torchvision
from PIL import Image, ImageDraw, ImageFont

from distribuuuu.dist import group as du
from distribuuuu.reporting.meters import per_class_top1

CONFUSION_CSV = "confusion_matrix.csv"
CONFUSION_PNG = "confusion_matrix.png"
PER_CLASS_CSV = "per_class_accuracy.csv"
# Per-class scalars and the confusion image go to tensorboard up to this many
# classes (a 1000 x 1000 image is unreadable); the histogram always does.
MAX_PLOTTED_CLASSES = 100


def versions() -> dict:
    """Versions of Python, torch, torchvision and, with CUDA, CUDA/cuDNN/NCCL."""
    found = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
    }
    if torch.cuda.is_available():
        found["cuda"] = torch.version.cuda
        found["cudnn"] = torch.backends.cudnn.version()
        if du.is_distributed() and torch.distributed.is_nccl_available():
            found["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        found["gpu"] = torch.cuda.get_device_name()
    return found


def world_layout(info: du.LaunchInfo, device: torch.device) -> dict:
    """Hosts, ranks and devices of the job: a collective, every rank calls it."""
    here = (socket.gethostname(), info.local_rank, str(device))
    everyone = du.all_gather_object(here)
    hosts: dict[str, list[int]] = {}
    for rank, (host, _, _) in enumerate(everyone):
        hosts.setdefault(host, []).append(rank)
    layout = {
        "launcher": info.launcher,
        "world_size": info.world_size,
        "nodes": len(hosts),
        "ranks_per_node": {host: ranks for host, ranks in hosts.items()},
        "devices": sorted({dev for _, _, dev in everyone}),
        "threads_per_process": torch.get_num_threads(),
    }
    if du.is_distributed():
        layout["backend"] = torch.distributed.get_backend()
        layout["master"] = f"{info.master_addr}:{info.master_port}"
    return layout


def model_size(model: torch.nn.Module) -> dict:
    """Parameter count and the size of parameters and buffers in MiB."""
    params = sum(p.numel() for p in model.parameters())
    tensors = [*model.parameters(), *model.buffers()]
    size = sum(t.numel() * t.element_size() for t in tensors)
    return {"parameters": params, "size_mb": size / 2**20}


def parameter_mb(model: torch.nn.Module) -> float:
    """MiB of parameters this process stores (its shards of sharded ones)."""
    from torch.distributed.tensor import DTensor

    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    return sum(p.numel() * p.element_size() for p in local) / 2**20


def _count(value: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if value >= scale:
            return f"{value / scale:.2f} {unit}"
    return str(int(value))


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ",".join(map(str, ranks))


def _memory(memory: dict) -> str:
    if "gradients_mb" not in memory:
        return (
            f"{memory['parameters_mb']:.2f} MiB of parameters on the fullest "
            "process (gradients as much, optimizer state by OPTIM)"
        )
    return (
        f"{memory['parameters_mb']:.2f} MiB of parameters, "
        f"{memory['gradients_mb']:.2f} MiB of gradients, "
        f"{memory['optimizer_mb']:.2f} MiB of optimizer state on the fullest process"
    )


def format_startup(report: dict) -> str:
    """The start-up report (:func:`distribuuuu.engine.trainer.startup_report`),
    as text."""
    world, data, model, batch = (
        report["world"],
        report["data"],
        report["model"],
        report["batch"],
    )
    nodes = ", ".join(
        f"{host} ({_ranks(ranks)})" for host, ranks in world["ranks_per_node"].items()
    )
    comm = ""
    if "backend" in world:
        comm = f", backend {world['backend']}, master {world['master']}"
    # The processes of a pipeline share their batches: one data-parallel replica.
    replica, many = ("process", "process(es)")
    if batch["world_size"] != world["world_size"]:
        replica, many = "replica", "replica(s)"
    classes = data["class_names"]
    shown = ", ".join(classes[:10]) + (", ..." if len(classes) > 10 else "")
    lines = [
        "start-up report",
        "  versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()),
        f"  world: {world['world_size']} process(es) on {world['nodes']} node(s): "
        f"{nodes}; launcher {world['launcher']}{comm}; device "
        f"{'/'.join(world['devices'])}, {world['threads_per_process']} CPU "
        "thread(s) per process",
        f"  data: {data['name']}, {data['train_images']} train / "
        f"{data['val_images']} val images, {len(classes)} classes ({shown}), "
        f"decoder {data['decoder']}",
        f"  model: {model['arch']}, {_count(model['parameters'])} parameters, "
        f"{model['size_mb']:.2f} MiB; SyncBN {'on' if model['syncbn'] else 'off'}",
        "  memory: " + _memory(report["memory"]),
        f"  batch: {batch['per_rank']} per {replica} x {batch['accum']} "
        f"accumulation step(s) x {batch['world_size']} {many} = global batch "
        f"{batch['global']}; LR {report['lr']:.5g} ({report['lr_policy']}); "
        f"strategy {report['strategy']}; precision {report['precision']}; "
        f"seed {report['seed']}",
        f"  start: {report['start']}",
    ]
    if "plan" in report:  # DIST.STRATEGY auto's
        table = report["plan"]["table"] or f"chosen: {report['plan']['why']}"
        lines.append("  plan (DIST.STRATEGY auto):")
        lines.extend("    " + line for line in table.splitlines())
    return "\n".join(lines)


def per_class_rows(matrix: torch.Tensor, classes: list[str]) -> list[tuple]:
    """``(class name, samples, correct, top-1 percent or None)`` for every class."""
    names = list(classes) + [str(i) for i in range(len(classes), len(matrix))]
    samples = matrix.sum(dim=1).tolist()
    correct = matrix.diagonal().tolist()
    return list(zip(names, samples, correct, per_class_top1(matrix)))


def format_per_class(matrix: torch.Tensor, classes: list[str], limit: int = 40) -> str:
    """A per-class accuracy table; beyond ``limit`` classes the worst and best."""
    rows = per_class_rows(matrix, classes)
    width = max(5, *(len(row[0]) for row in rows))
    header = f"{'class':<{width}}  {'samples':>7}  {'top1':>6}"
    shown = rows
    note = ""
    if len(rows) > limit:
        ranked = sorted(
            (row for row in rows if row[3] is not None), key=lambda row: row[3]
        )
        shown = ranked[: limit // 2] + ranked[-(limit // 2) :]
        note = (
            f"(the {limit // 2} worst and {limit // 2} best of {len(rows)} "
            f"classes; all in {PER_CLASS_CSV})"
        )
    lines = [header]
    for name, count, _, top1 in shown:
        value = "-" if top1 is None else f"{top1:.2f}"
        lines.append(f"{name:<{width}}  {count:>7}  {value:>6}")
    return "\n".join(lines + ([note] if note else []))


def write_per_class(out_dir: str, matrix: torch.Tensor, classes: list[str]) -> list:
    """Write the confusion matrix (CSV, PNG) and per-class accuracy CSV; paths."""
    names = [row[0] for row in per_class_rows(matrix, classes)]
    paths = [os.path.join(out_dir, name) for name in (CONFUSION_CSV, PER_CLASS_CSV)]
    with open(paths[0], "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["true \\ predicted", *names])
        for name, row in zip(names, matrix.tolist()):
            writer.writerow([name, *row])
    with open(paths[1], "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["class", "samples", "correct", "top1"])
        for name, count, correct, top1 in per_class_rows(matrix, classes):
            writer.writerow([name, count, correct, "" if top1 is None else top1])
    png = os.path.join(out_dir, CONFUSION_PNG)
    Image.fromarray(confusion_image(matrix, names)).save(png)
    return [*paths, png]


# The two ends of the colour scale: a near-white and a dark blue.
_LIGHT, _DARK = np.array([247, 251, 255]), np.array([8, 48, 107])


def confusion_image(matrix: torch.Tensor, classes: list[str]) -> np.ndarray:
    """The confusion matrix as an HxWx3 uint8 image.

    Rows are true classes, columns predictions; a cell's colour is its share
    of the row (white 0 to dark blue 1).  Class names label the axes and
    counts fill the cells while they fit.
    """
    n = len(matrix)
    cell = max(2, min(36, 720 // n))
    labelled = cell >= 12
    longest = max(len(name) for name in classes) + len(str(n)) + 1
    left = min(160, 8 + 7 * longest) if labelled else 4
    top = 18 if labelled else 4
    rows = matrix.double()
    share = (rows / rows.sum(dim=1, keepdim=True).clamp(min=1)).numpy()
    colours = _LIGHT + share[..., None] * (_DARK - _LIGHT)
    cells = np.repeat(np.repeat(colours, cell, axis=0), cell, axis=1)
    canvas = np.full((top + n * cell + 20, left + n * cell + 4, 3), 255, np.uint8)
    canvas[top : top + n * cell, left : left + n * cell] = cells
    image = Image.fromarray(canvas)
    draw, font, black = ImageDraw.Draw(image), ImageFont.load_default(), (0, 0, 0)
    legend = "rows: true class, columns: predicted"
    draw.text((2, top + n * cell + 4), legend, fill=black, font=font)
    if labelled:
        # Columns show the names when they fit, else the labels (0, 1, ...),
        # which the rows then show before the names.
        names_fit = 7 * max(len(name) for name in classes) <= cell
        for i, name in enumerate(classes[:n]):
            middle = i * cell + cell // 2
            column, row = (name, name) if names_fit else (str(i), f"{i} {name}")
            draw.text((2, top + middle), row, fill=black, font=font, anchor="lm")
            above = (left + middle, top - 3)
            draw.text(above, column, fill=black, font=font, anchor="ms")
    if cell >= 24:
        for (true, pred), count in np.ndenumerate(matrix.numpy()):
            ink = (255, 255, 255) if share[true, pred] > 0.5 else black
            center = (left + pred * cell + cell // 2, top + true * cell + cell // 2)
            draw.text(center, str(count), fill=ink, font=font, anchor="mm")
    return np.asarray(image)
