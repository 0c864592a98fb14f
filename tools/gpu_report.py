#!/usr/bin/env python3
"""The report of tools/gpu_check.sh: what each step wrote (a run's peak memory
and the start-up report's figure, the cuda tests' counts, the throughput,
the versions), read into ``gpu_report.json`` and shown as ``gpu_report.md``.

    python tools/gpu_report.py --work WORK --out OUT

``WORK/steps.json`` holds the steps' results as gpu_check.py wrote them.
Imports only the standard library.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from xml.etree import ElementTree

NOT_HERE = (
    "Not run on one GPU: pipeline and tensor parallelism need two GPUs (gloo "
    "has no CUDA send and receive), and so do the two-GPU tests, which skip; the "
    "device audit (tests/test_device_audit.py) covers their devices on the CPU."
)


# --------------------------------------------------------------------------- #
# What the steps wrote
# --------------------------------------------------------------------------- #
def run_details(out_dir: str) -> dict:
    """Peak memory (MiB), its start-up prediction and top-1 of a finished run,
    from its metrics.jsonl: the start-up report's parameters, gradients and
    optimizer state (no activations: a floor of the peak), the evaluation
    record's peaks of every device."""
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    details = {}
    for record in records:
        if record.get("split") == "start" and "memory" in record:
            details["predicted_mib"] = round(sum(record["memory"].values()), 1)
        elif record.get("split") == "val":
            details["peak_mib"] = round(max(record["peak_mem_mb"]), 1)
            details["train_peak_mib"] = round(max(record["train_peak_mem_mb"]), 1)
            details["top1"] = record["top1"]
    return details


def junit_details(xml: str) -> dict:
    """Counts and failed names of a pytest junit-xml file."""
    if not os.path.isfile(xml):
        return {}
    root = ElementTree.parse(xml).getroot()
    cases = list(root.iter("testcase"))
    failed = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in cases
        if case.find("failure") is not None or case.find("error") is not None
    ]
    skipped = sum(case.find("skipped") is not None for case in cases)
    passed = len(cases) - len(failed) - skipped
    return {"passed": passed, "failed_tests": failed, "skipped": skipped}


def throughput_details(path: str) -> dict:
    """img/s of ours and the minimal loop, and their ratio (medians)."""
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        train = json.load(f)["results"]["train_step"]
    return {side: round(train[side]["median"], 3) for side in ("ours", "minimal")} | {
        "ratio": round(train["ratio"]["median"], 3)
    }


def add_details(steps: dict, work: str) -> None:
    """Read what the steps wrote into their results."""
    for result in steps.values():
        if result.get("out_dir"):
            result.update(run_details(result["out_dir"]))
    readers = {
        "cuda_tests": (junit_details, "cuda_tests.xml"),
        "throughput": (throughput_details, "benchmark.json"),
        "wheels": (read_json, "wheels.json"),
    }
    for name, (reader, file) in readers.items():
        if name in steps:
            steps[name].update(reader(os.path.join(work, file)))
    environment = steps.get("environment", {})
    printed = environment.get("output", "").splitlines()
    found = [line for line in printed if line.startswith("{")]
    if environment.get("status") == "passed" and found:
        environment.update(json.loads(found[-1]))


def read_json(path: str) -> dict:
    """A JSON file's object ({} where there is none)."""
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# --------------------------------------------------------------------------- #
# The report
# --------------------------------------------------------------------------- #
def device_line(environment: dict) -> str:
    """The device and versions, in one line."""
    if "torch" not in environment:
        return "unknown (the environment step failed)"
    gpus = ", ".join(environment["gpus"]) or "no GPU"
    return (
        f"{gpus}; torch {environment['torch']} (CUDA {environment['cuda']}, "
        f"NCCL {environment['nccl'] or 'none'}), "
        f"torchvision {environment['torchvision']}, "
        f"Python {environment['python']}, DeepSpeed {environment['deepspeed']}"
    )


def findings(steps: dict) -> list[str]:
    """The lines under the table: the cuda tests, throughput and wheels."""
    lines = []
    tests = steps.get("cuda_tests", {})
    if "passed" in tests:
        failed, skipped = tests["failed_tests"], tests["skipped"]
        counts = f"{tests['passed']} passed, {len(failed)} failed, {skipped} skipped"
        lines += ["", f"cuda tests: {counts}"]
        lines += [f"- failed: {name}" for name in failed]
    printed = steps.get("cuda_tests_collected", {}).get("output", "")
    collected = re.search(r"(\d+)(/\d+)? tests? collected", printed)
    if collected:
        lines += ["", f"cuda tests collected: {collected.group(1)}"]
    speed = steps.get("throughput", {})
    if "ratio" in speed:
        sides = f"ours {speed['ours']}, minimal loop {speed['minimal']}"
        lines += ["", f"throughput (img/s, medians): {sides}, ratio {speed['ratio']}"]
    wheels = steps.get("wheels", {})
    if wheels.get("files"):
        carried = ", ".join(wheels["files"])
        lines += ["", f"wheels carried ({wheels['size_mb']} MiB): {carried}"]
    return lines


def format_report(report: dict) -> str:
    """The report as markdown."""
    steps = report["steps"]
    counts: dict[str, int] = {}
    for result in steps.values():
        counts[result["status"]] = counts.get(result["status"], 0) + 1
    lines = [
        "# GPU check",
        "",
        f"- date: {report['date']}",
        f"- mode: {report['mode']}",
        f"- device: {device_line(steps.get('environment', {}))}",
        f"- steps: {', '.join(f'{n} {status}' for status, n in counts.items())}",
        "",
        "| step | status | s | peak MiB (train) | start-up MiB | what, notes |",
        "|---|---|---|---|---|---|",
    ]
    for name, result in steps.items():
        peak = str(result.get("peak_mib", ""))
        if "train_peak_mib" in result:
            peak += f" ({result['train_peak_mib']})"
        what = "; ".join(filter(None, [result["what"], result.get("note")]))
        lines.append(
            f"| {name} | {result['status']} | {result.get('seconds', '')} "
            f"| {peak} | {result.get('predicted_mib', '')} | {what} |"
        )
    lines += findings(steps)
    lines += [
        "",
        "start-up MiB: the start-up report's parameters, gradients and "
        "optimizer state; activations come on top.",
        "",
        NOT_HERE,
    ]
    for name, result in steps.items():
        if result["status"] in ("failed", "timed out") and result.get("output"):
            lines += ["", f"## {name}: {result['status']}", "", "```"]
            lines += [result["output"], "```"]
    return "\n".join(lines) + "\n"


def write_report(out: str, report: dict) -> None:
    """gpu_report.md and gpu_report.json in ``out``."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "gpu_report.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(out, "gpu_report.md"), "w", encoding="utf-8") as f:
        f.write(format_report(report))


def main(argv: list[str] | None = None) -> int:
    """Read WORK/steps.json and what the steps wrote; write the report."""
    parser = argparse.ArgumentParser(prog="gpu_report.py", description=__doc__)
    parser.add_argument("--work", required=True, help="gpu_check.py's work folder")
    parser.add_argument("--out", required=True, help="where the report goes")
    args = parser.parse_args(argv)
    report = read_json(os.path.join(args.work, "steps.json"))
    add_details(report["steps"], args.work)
    write_report(args.out, report)
    print(format_report(report))
    print(f"wrote {args.out}/gpu_report.md and gpu_report.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
