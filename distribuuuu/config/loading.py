"""Loading a config: bounded yaml, ``_BASE_`` chains, ``KEY VALUE`` overrides.

Every value is checked against its default's type as it is merged (a renamed
key is accepted with a warning); :func:`load_cfg` then validates and freezes.
Also the ways a cfg is written out: the dump in OUT_DIR, the flat and diff
views, and the annotated yaml of ``--print-config``.
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import logging
import math
import os
from typing import Any

import yaml
from yacs.config import CfgNode

from distribuuuu.config.defaults import DEFAULTS, get_cfg
from distribuuuu.config.keys import LIST_ITEMS, NULLABLE, RENAMED, all_keys, get_key
from distribuuuu.config.validation import validate_cfg
from distribuuuu.errors import ConfigError
from distribuuuu.fileio import atomic_write

# The package's logger, as before the split (the renamed-key warnings).
logger = logging.getLogger("distribuuuu.config")


def _unknown_key(key: str, where: str) -> ConfigError:
    candidates = all_keys(DEFAULTS) + list(RENAMED)
    close = difflib.get_close_matches(key.upper(), candidates, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else ""
    return ConfigError(f"{where}unknown config key {key}{hint}")


def _type_name(types: tuple) -> str:
    return " or ".join(t.__name__ for t in types)


def _coerce(key: str, value: Any, default: Any, where: str) -> Any:
    """Check ``value`` against the default's type; return the value to store."""

    def bad(expected: str) -> ConfigError:
        """The error naming the key, what it takes and the value given."""
        return ConfigError(f"{where}{key}: expected {expected}, got {value!r}")

    # Every key, lists included: inf and nan (1e999, .inf, .nan) are no setting.
    items = value if isinstance(value, (list, tuple)) else [value]
    if any(isinstance(item, float) and not math.isfinite(item) for item in items):
        raise bad("a finite number")

    if default is None or key in NULLABLE:
        if value is None or (
            isinstance(value, str) and value.lower() in ("none", "null")
        ):
            return None
        want = NULLABLE[key]
        if isinstance(value, want) and not isinstance(value, bool):
            return value
        raise bad(f"{want.__name__} or null")
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise bad("True or False")
    if isinstance(default, int):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad("an integer")
    if isinstance(default, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise bad("a number")
    if isinstance(default, str):
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise bad("a string")
    if isinstance(default, (list, tuple)):
        if not isinstance(value, (list, tuple)):
            raise bad("a list such as [1, 2]")
        item_types = LIST_ITEMS.get(key)
        if item_types:
            for item in value:
                if isinstance(item, bool) or not isinstance(item, item_types):
                    raise bad(f"a list of {_type_name(item_types)}")
        return list(value)
    raise bad(type(default).__name__)


def _set_key(cfg: CfgNode, key: str, value: Any, where: str) -> None:
    """Set dotted ``key`` in ``cfg`` after checking it exists and its type."""
    if key in RENAMED:
        logger.warning("%s%s is deprecated; use %s", where, key, RENAMED[key])
        key = RENAMED[key]
    node = cfg
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, CfgNode):
            raise _unknown_key(key, where)
        node = child
    name = parts[-1]
    if name not in node:
        raise _unknown_key(key, where)
    if isinstance(node[name], CfgNode):
        raise ConfigError(f"{where}{key} is a section; set one of its keys instead")
    node[name] = _coerce(key, value, _default_value(key), where)


def _default_value(key: str) -> Any:
    """The default of dotted ``key``; KeyError when there is no such key."""
    return get_key(DEFAULTS, key)


def _flatten(mapping: dict, prefix: str = "") -> list[tuple[str, Any]]:
    items = []
    for name, value in mapping.items():
        full = f"{prefix}{name}"
        if isinstance(value, dict):
            items += _flatten(value, full + ".")
        else:
            items.append((full, value))
    return items


# Bounds of a yaml config (a --cfg file, a _BASE_, the cfg dump of a
# checkpoint): the defaults dump to about 6 KB, 3 levels and 500 values.
MAX_YAML_BYTES = 1 << 20
MAX_YAML_DEPTH = 64
# Values after expanding aliases (*name): a few nested aliases of a small
# file would otherwise expand to billions ("billion laughs").
MAX_YAML_NODES = 100_000
_MERGE_TAG = "tag:yaml.org,2002:merge"


class _BoundedLoader(yaml.SafeLoader):
    """yaml's SafeLoader with bounded nesting and alias expansion.

    Checked while the document is composed, before any value is built: each
    node's depth and size count what its aliases stand for, so the limits
    hold for the expanded document that callers walk.
    """

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self._nesting = 0
        self._expanded: dict[int, tuple[yaml.Node, int, int]] = {}

    def compose_node(self, parent, index) -> yaml.Node:
        """Compose one node as yaml does, counting its depth and expanded size."""
        self._nesting += 1
        if self._nesting > MAX_YAML_DEPTH:
            raise ConfigError(f"nested deeper than {MAX_YAML_DEPTH} levels")
        alias = self.check_event(yaml.AliasEvent)
        node = super().compose_node(parent, index)
        self._nesting -= 1
        if alias:  # the anchored node again, complete unless it holds the alias
            if id(node) not in self._expanded:
                raise ConfigError("an alias (*name) inside the value it names")
            return node
        children: list = []
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [child for pair in node.value for child in pair]
        sizes = [self._expanded[id(child)] for child in children]
        depth = 1 + max((d for _, d, _ in sizes), default=0)
        size = 1 + sum(n for _, _, n in sizes)
        if depth > MAX_YAML_DEPTH:
            raise ConfigError(
                f"its aliases (*name) expand to more than {MAX_YAML_DEPTH} levels"
            )
        if size > MAX_YAML_NODES:
            raise ConfigError(
                f"more than {MAX_YAML_NODES} values once its aliases (*name) are "
                "expanded"
            )
        self._expanded[id(node)] = (node, depth, size)
        return node

    def construct_mapping(self, node, deep=False) -> dict:
        """A mapping as yaml builds it, refusing a key given twice (yaml keeps
        the last silently: a second ``OPTIM:`` block would drop the first).

        A merge (``<<: *name``) may still be overridden by the mapping's keys.
        """
        if isinstance(node, yaml.MappingNode):
            lines: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE_TAG:
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                with contextlib.suppress(TypeError):  # unhashable: yaml refuses it
                    if key in lines:
                        raise ConfigError(
                            f"key {key} is given twice (lines {lines[key]} and {line})"
                        )
                    lines[key] = line
        return super().construct_mapping(node, deep)


def parse_yaml(text: str) -> Any:
    """Parse yaml ``text`` (at most MAX_YAML_BYTES) safely and with bounds.

    Raises ConfigError for a text too large, too deep or whose aliases
    expand too far, and yaml.YAMLError for invalid yaml.
    """
    if len(text.encode("utf-8", "surrogatepass")) > MAX_YAML_BYTES:
        raise ConfigError(f"larger than {MAX_YAML_BYTES // 1024} KiB")
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _read_yaml(path: str) -> dict:
    """Read a yaml config file as a mapping, refusing anything else."""
    if os.path.isdir(path):
        raise ConfigError(f"--cfg {path}: is a directory, not a yaml file")
    if not path.endswith((".yaml", ".yml")):
        raise ConfigError(
            f"--cfg {path}: config files are .yaml or .yml files (code such as a "
            ".py config is never run)"
        )
    if not os.path.isfile(path):
        raise ConfigError(f"--cfg {path}: no such file")
    if os.path.getsize(path) > MAX_YAML_BYTES:
        raise ConfigError(
            f"--cfg {path}: larger than {MAX_YAML_BYTES // 1024} KiB; a config "
            "file holds a few keys"
        )
    try:
        with open(path, encoding="utf-8") as f:
            data = parse_yaml(f.read(MAX_YAML_BYTES + 1))
    except UnicodeDecodeError:
        raise ConfigError(f"--cfg {path}: not a UTF-8 text file") from None
    except ConfigError as e:
        raise ConfigError(f"--cfg {path}: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" (line {mark.line + 1})" if mark is not None else ""
        raise ConfigError(f"--cfg {path}: invalid yaml{line}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"--cfg {path}: expected a mapping of keys, got a {type(data).__name__}"
        )
    return data


def merge_from_file(cfg: CfgNode, path: str, _seen: tuple = ()) -> None:
    """Merge a yaml file (after its ``_BASE_`` chain) into ``cfg``."""
    path = os.path.abspath(path)
    if path in _seen:
        raise ConfigError(f"--cfg {path}: _BASE_ includes itself")
    data = _read_yaml(path)
    base = data.pop("_BASE_", None)
    if base is not None:
        if not isinstance(base, str):
            raise ConfigError(f"--cfg {path}: _BASE_ must be a file name")
        base_path = os.path.join(os.path.dirname(path), os.path.expanduser(base))
        merge_from_file(cfg, base_path, _seen + (path,))
    for key, value in _flatten(data):
        _set_key(cfg, key, value, f"{os.path.basename(path)}: ")


def _parse_cli_value(raw: str) -> Any:
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw


def merge_from_list(cfg: CfgNode, opts: list[str]) -> None:
    """Merge ``KEY VALUE`` pairs from the command line into ``cfg``."""
    if len(opts) % 2:
        raise ConfigError(f"overrides come in KEY VALUE pairs; {opts[-1]} has no value")
    for key, raw in zip(opts[0::2], opts[1::2]):
        value = _parse_cli_value(raw)
        # A string key given a number-looking value keeps the text as typed.
        if isinstance(_default_or_none(key), str) and not isinstance(value, str):
            value = raw
        _set_key(cfg, key, value, "")


def merge_resolved(cfg: CfgNode, keys: dict[str, Any]) -> None:
    """Write values the run resolved at start-up (``keys``: dotted key ->
    value) into ``cfg``, frozen or not, so that config.yaml records them.

    Each goes through the command line's parsing and checks; ConfigError or
    ValueError for a value that does not fit its key.
    """
    frozen = cfg.is_frozen()
    cfg.defrost()
    try:
        merge_from_list(cfg, [str(x) for pair in keys.items() for x in pair])
    finally:
        if frozen:
            cfg.freeze()


def _default_or_none(key: str) -> Any:
    """The default of ``key`` (or of the key it was renamed to); None if unknown."""
    try:
        return _default_value(RENAMED.get(key, key))
    except KeyError:
        return None


def merge_cfg(cfg_file: str | None = None, opts: list[str] | None = None) -> CfgNode:
    """Defaults, file and overrides, not yet validated (which imports torch)."""
    cfg = get_cfg()
    if cfg_file:
        merge_from_file(cfg, cfg_file)
    merge_from_list(cfg, list(opts or []))
    return cfg


def load_cfg(cfg_file: str | None = None, opts: list[str] | None = None) -> CfgNode:
    """Build the frozen run config: defaults, file, overrides, validation."""
    cfg = merge_cfg(cfg_file, opts)
    validate_cfg(cfg)
    cfg.freeze()
    return cfg


def dump_cfg(
    cfg: CfgNode, out_dir: str | None = None, *, text: str | None = None
) -> str:
    """Write ``cfg`` to ``OUT_DIR/CFG_DEST`` (call on rank 0); return the path.

    ``text``: the yaml to write instead of ``cfg.dump()`` (the run's record,
    with the values it resolved).  Atomic, as checkpoints are: a crash, a
    signal or a full disk leaves no partial file.
    """
    path = os.path.join(out_dir or cfg.OUT_DIR, cfg.CFG_DEST)
    text = cfg.dump() if text is None else text
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))
    return path


def yaml_value(value: Any) -> str:
    """``value`` as one line of yaml: ``null``, ``''``, ``0.1``, ``[1, 2]``, ..."""
    return yaml.safe_dump([value], default_flow_style=True, width=2**16).strip()[1:-1]


def flat_cfg(cfg: CfgNode) -> dict[str, Any]:
    """Every key of ``cfg`` (dotted) with its value, in the tree's order."""
    return {key: get_key(cfg, key) for key in all_keys(cfg)}


def diff_from_defaults(cfg: CfgNode) -> list[tuple[str, Any, Any]]:
    """``(key, value, default)`` of every key whose value is not the default.

    Keys unknown to the defaults (a cfg of another version) have default None.
    """
    return [
        (key, value, _default_or_none(key))
        for key, value in flat_cfg(cfg).items()
        if value != _default_or_none(key)
    ]


def format_cfg(cfg: CfgNode) -> str:
    """``cfg`` as yaml (loadable with --cfg), each non-default value marked.

    A changed value ends with ``# default: <value>``.
    """
    changed = {key: default for key, _, default in diff_from_defaults(cfg)}
    lines = []

    def emit(node: CfgNode, prefix: str, indent: str) -> None:
        """Append the lines of ``node``, keys sorted, sections indented."""
        for name in sorted(node):
            value, key = node[name], prefix + name
            if isinstance(value, CfgNode):
                lines.append(f"{indent}{name}:")
                emit(value, key + ".", indent + "  ")
                continue
            line = f"{indent}{name}: {yaml_value(value)}"
            if key in changed:
                line += f"  # default: {yaml_value(changed[key])}"
            lines.append(line)

    emit(cfg, "", "")
    return "\n".join(lines) + "\n"
