#!/usr/bin/env python3
"""Plan a run on paper: which strategy, micro-batch and accumulation fit the
devices, and which is fastest.  Launches nothing.

    python tools/plan.py [--cfg FILE] [KEY VALUE ...] --nodes N --procs-per-node G
        --device cpu|"NVIDIA H100"|... [--device-memory GiB]
        [--intra-gbps G] [--inter-gbps G] [--latency-us U] [--json]

The global batch is the one plain ddp would have on this world
(TRAIN.BATCH_SIZE x TRAIN.ACCUM_STEPS x processes).  Memory per rank is
traced with fake tensors in this process; step time comes from the model's
FLOPs, the device's datasheet and the links' flags (docs/planner.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from distribuuuu import cli, preflight
from distribuuuu.errors import EXIT_UNUSABLE_INPUT, ConfigError
from distribuuuu.plan.paper import NO_DATA, PaperMachine, plan_on_paper
from distribuuuu.plan.search import NothingFitsError, format_table

EXIT_CODES = """exit codes:
  0    planned
  2    unusable flags or config, a device the planner does not know, or no
       candidate fits the devices' memory (the error line names the smallest
       memory any candidate needs)
"""


def _positive(kind: Callable[[str], float]) -> Callable[[str], float]:
    """An argparse type: ``kind(text)``, which must be > 0."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
        return value

    return parse


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose errors are one ``error:`` line and exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        cli.print_error(f"{message} (see --help)", EXIT_UNUSABLE_INPUT)
        sys.exit(EXIT_UNUSABLE_INPUT)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line (``sys.argv[1:]`` when ``argv`` is None)."""
    parser = _Parser(
        prog="plan.py",
        description="Plan a run on paper: strategy, micro-batch, accumulation.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--cfg", dest="cfg_file", help="config file (yaml)")
    parser.add_argument("--nodes", type=_positive(int), required=True)
    parser.add_argument("--procs-per-node", type=_positive(int), required=True)
    parser.add_argument(
        "--device", required=True, help='cpu, or a GPU\'s name ("NVIDIA H100")'
    )
    parser.add_argument(
        "--device-memory",
        type=_positive(float),
        metavar="GiB",
        help="memory of one device (default: its datasheet's; a CPU: RAM / procs)",
    )
    parser.add_argument("--intra-gbps", type=_positive(float), metavar="Gbit/s")
    parser.add_argument("--inter-gbps", type=_positive(float), metavar="Gbit/s")
    parser.add_argument("--latency-us", type=_positive(float), metavar="us")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    cli.add_debug_option(parser)
    parser.add_argument("opts", nargs=argparse.REMAINDER, help="KEY VALUE overrides")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    args = parse_args(argv)
    machine = PaperMachine(
        nodes=args.nodes,
        procs_per_node=args.procs_per_node,
        device=args.device,
        device_memory_gib=args.device_memory,
        intra_gbps=args.intra_gbps,
        inter_gbps=args.inter_gbps,
        latency_us=args.latency_us,
    )

    def plan_and_print() -> None:
        """Load the config, plan, print the table or the JSON object."""
        cfg = preflight.load_checked_cfg(args.cfg_file, [*args.opts, *NO_DATA])
        result = plan_on_paper(cfg, machine)
        print(json.dumps(result.as_dict()) if args.json else format_table(result))

    rules = (cli.ErrorExit((ConfigError, NothingFitsError), EXIT_UNUSABLE_INPUT, str),)
    return cli.run_tool(plan_and_print, args.debug, rules)


if __name__ == "__main__":
    sys.exit(main())
