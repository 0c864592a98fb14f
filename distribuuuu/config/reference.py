"""The config reference: every key with its default and comment, as Markdown.

The comments are read from the source of :mod:`distribuuuu.config.defaults`
(the ``# ...`` lines right above each ``_C.KEY = value`` line), so that the
defaults file stays the one place that documents a key.  ``--help-config``
prints the reference, and docs/config-reference.md holds it
(tools/update_config_reference.py).
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from typing import Any

from yacs.config import CfgNode

from distribuuuu.config import defaults as defaults_module
from distribuuuu.config.keys import CHOICES, all_keys, get_key
from distribuuuu.config.loading import yaml_value

_BANNER = re.compile(r"#\s*-{3}")
# A space before a word that would start a Markdown block (list item, heading,
# quote, fence, underline) if a wrapped line began with it.
_BLOCK_WORD = re.compile(r" (?=(?:[-+*=]+|#+|\d+[.)]|>\S*|~~~\S*)(?: |$))")
_REFERENCE_WIDTH = 88


def _target_key(target: ast.expr) -> str | None:
    """``MODEL.ARCH`` for the assignment target ``_C.MODEL.ARCH``, else None."""
    names: list[str] = []
    while isinstance(target, ast.Attribute):
        names.insert(0, target.attr)
        target = target.value
    if names and isinstance(target, ast.Name) and target.id == "_C":
        return ".".join(names)
    return None


def _comment_above(lines: list[str], index: int) -> str:
    """The ``#`` lines right above ``lines[index]``, joined; banners do not count."""
    parts: list[str] = []
    while index > 0:
        line = lines[index - 1].strip()
        if not line.startswith("#") or _BANNER.match(line):
            break
        parts.insert(0, line.lstrip("#").strip())
        index -= 1
    return " ".join(part for part in parts if part)


def _key_comments(source: str) -> dict[str, str]:
    """Map the key of every ``_C.KEY = value`` line of ``source`` to its comment."""
    lines = source.splitlines()
    comments = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            key = _target_key(node.targets[0])
            if key is not None:
                comments[key] = _comment_above(lines, node.lineno - 1)
    return comments


def describe_keys(
    defaults: CfgNode | None = None, source: str | None = None
) -> list[tuple[str, Any, str]]:
    """``(key, default, comment)`` for every key of the defaults, in file order.

    Args:
        defaults: the tree to describe; the defaults tree when None.
        source: Python source with a ``_C.KEY = value`` line for every key, under
            its ``# ...`` comment lines; the source of the defaults module when
            None.

    Raises ValueError for a key without a comment: a developer's mistake.
    """
    defaults = defaults_module.DEFAULTS if defaults is None else defaults
    if source is None:
        source = inspect.getsource(defaults_module)
    comments = _key_comments(source)
    described = []
    for key in all_keys(defaults):
        if not comments.get(key):
            raise ValueError(
                f"config key {key} has no comment: put '# ...' lines describing it "
                f"right above '_C.{key} = ...' in {defaults_module.__name__}"
            )
        described.append((key, get_key(defaults, key), comments[key]))
    return described


def _markdown_text(text: str) -> str:
    """``text`` for Markdown: quoted and ``*`` words as code; ``\\ ` < $`` escaped."""
    parts = re.split(r'"([^"\s][^"]*)"', text)
    for index, part in enumerate(parts):
        if index % 2:
            parts[index] = f"`{part}`"
        else:
            part = re.sub(r"([\\`<$])", r"\\\1", part)
            parts[index] = re.sub(r"[\w./-]*\*[\w./*-]*", r"`\g<0>`", part)
    return "".join(parts)


def _reference_item(key: str, default: Any, comment: str) -> list[str]:
    """The wrapped Markdown list item of one key: name, default, comment, choices."""
    text = _markdown_text(comment)
    if not text.endswith((".", "?", "!")):
        text += "."
    if key in CHOICES:
        choices = ", ".join(f"`{yaml_value(choice)}`" for choice in CHOICES[key])
        text += f" Choices: {choices}."
    item = f"- `{key}` = `{yaml_value(default)}`: {text}"
    lines = textwrap.wrap(
        _BLOCK_WORD.sub("\0", item),  # glued: such a word never begins a line
        width=_REFERENCE_WIDTH,
        subsequent_indent="  ",
        break_long_words=False,
        break_on_hyphens=False,
    )
    return [line.replace("\0", " ") for line in lines]


def format_config_reference() -> str:
    """Every config key with its default and comment, as Markdown (--help-config).

    A ``### SECTION`` heading per section (top-level keys last) and a list item
    per key, wrapped at 88 columns: it reads in a terminal and is embedded
    verbatim in docs/config-reference.md.
    """
    sections: dict[str, list[str]] = {}
    for key, default, comment in describe_keys():
        section = key.rpartition(".")[0] or "Top level"
        sections.setdefault(section, []).extend(_reference_item(key, default, comment))
    blocks = [f"### {name}\n\n" + "\n".join(lines) for name, lines in sections.items()]
    return "\n\n".join(blocks) + "\n"
