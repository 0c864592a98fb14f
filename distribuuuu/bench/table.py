"""The table tools/benchmark.py prints: a row per measurement, medians with
the (slowest-fastest) repeats beside them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from distribuuuu.bench.async_save import format_async_save
from distribuuuu.bench.comm_hooks import format_comm_hooks
from distribuuuu.bench.folder_scan import format_folder_scan
from distribuuuu.bench.overheads import format_stop_check
from distribuuuu.bench.pipeline_bubble import format_bubble
from distribuuuu.bench.plan_accuracy import format_accuracy
from distribuuuu.bench.plan_links import format_plan_links
from distribuuuu.bench.plan_timing import format_plan_timing
from distribuuuu.bench.strategy_loops import format_loops


def side_row(name: str, result: dict, unit: str = "img/s") -> str:
    skip = ("ratio", "ratios", "cpu", "prepared")
    sides = [key for key in result if key not in skip]
    cells = [
        f"{key} {result[key]['median']:.1f} ({result[key]['min']:.1f}-"
        f"{result[key]['max']:.1f})"
        for key in sides
    ]
    text = f"{name:<18} {unit:<6} " + "  ".join(cells)
    ratios = result.get("ratios")
    if ratios is None:  # two sides: the ratio of the first to the second
        ratios = {"": result["ratio"]} if "ratio" in result else {}
    for side, ratio in ratios.items():
        spread = f"{ratio['min']:.3f}-{ratio['max']:.3f}"
        text += f"  {f'ratio {side}'.rstrip()} {ratio['median']:.3f} ({spread})"
    return text


def format_table(results: dict) -> str:
    """The results as text: medians with (slowest-fastest) repeats."""
    lines = ["measurement        unit   median (min-max) per side, ratio ours/other"]
    for name in ("train_step", "eval", "data_pipeline"):
        if name in results:
            lines.append(side_row(name, results[name]))
            if "cpu" in results[name]:
                lines.append(side_row(f"{name} cpu", results[name]["cpu"], "img/cs"))
    prepared = results.get("data_pipeline", {}).get("prepared")
    if prepared:  # not the same pixels: a row of its own
        lines.append(side_row("data prepared", prepared))
        lines.append(side_row("data prepared cpu", prepared["cpu"], "img/cs"))
    if "startup" in results:
        startup = results["startup"]
        for name, run in startup["runs"].items():
            row = "startup" if name == "dry run" else "startup workers"
            sides = {name: run["seconds"], "imports": startup["imports"]}
            lines.append(side_row(row, sides, "s"))
            lines.append(
                side_row(f"{row} beyond", {"beyond": run["beyond_imports"]}, "s")
            )
    if "stop_check" in results:
        lines.append(format_stop_check(results["stop_check"]))
    lines.append("img/cs: images per CPU-second of the process and its workers")
    rows: dict[str, Callable[[Any], str]] = {
        "async_save": format_async_save,
        "pipeline": format_bubble,
        "plan_memory": format_accuracy,
        "plan_timing": format_plan_timing,
        "plan_links": format_plan_links,
        "folder_scan": format_folder_scan,
        "comm_hooks": format_comm_hooks,
        "loops": format_loops,
    }
    lines += [row(results[name]) for name, row in rows.items() if name in results]
    return "\n".join(lines)
