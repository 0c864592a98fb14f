#!/usr/bin/env python3
"""Rewrite the config reference in README.md from the defaults and their comments.

    python tools/update_config_reference.py [--check] [README]

The reference is the output of ``python tools/train_net.py --help-config``; in
the README it stands between the lines ``<!-- config-reference:start -->`` and
``<!-- config-reference:end -->``.  With ``--check`` nothing changes and the
exit code is 1 when the README is out of date (tests/test_config.py checks it).
"""

from __future__ import annotations

import argparse
import os
import sys

from distribuuuu.config import format_config_reference

START = "<!-- config-reference:start -->"
END = "<!-- config-reference:end -->"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMAND = "python tools/update_config_reference.py"


def replace_reference(readme: str, reference: str) -> str:
    """``readme`` with the text between the two markers replaced by ``reference``."""
    start, end = readme.find(START), readme.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no {START} ... {END} block in the README")
    return f"{readme[: start + len(START)]}\n\n{reference}\n{readme[end:]}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line (``sys.argv[1:]`` when ``argv`` is None)."""
    parser = argparse.ArgumentParser(
        prog="update_config_reference.py",
        description="Rewrite README.md's config reference (--help-config output).",
    )
    parser.add_argument(
        "readme",
        nargs="?",
        default=os.path.join(REPO, "README.md"),
        help="the README to update (default: the repository's README.md)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="change nothing; exit 1 when the reference is out of date",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Update the README's reference (or only compare it); return the exit code."""
    args = parse_args(argv)
    with open(args.readme, encoding="utf-8") as f:
        current = f.read()
    try:
        updated = replace_reference(current, format_config_reference())
    except ValueError as error:  # no markers, or a key without a comment
        sys.stderr.write(f"error: {error}\n")
        return 2
    if updated == current:
        return 0
    if args.check:
        sys.stderr.write(
            f"{args.readme}: config reference out of date; run {COMMAND}\n"
        )
        return 1
    with open(args.readme, "w", encoding="utf-8") as f:
        f.write(updated)
    sys.stdout.write(f"{args.readme}: config reference updated\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
