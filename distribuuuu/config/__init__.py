"""The configuration tree: every default in one place, loading, validation.

Flow: defaults -> ``_BASE_`` chain -> yaml file -> ``KEY VALUE`` overrides ->
:func:`validate_cfg` -> freeze.  :func:`get_cfg` always returns a fresh clone;
library code receives the cfg as an argument and never imports a global one.

The modules of the package (import the names from here):

* :mod:`.defaults`: the commented defaults tree (frozen) and :func:`get_cfg`;
* :mod:`.keys`: choices, nullable, list and renamed keys; ConfigError;
* :mod:`.loading`: bounded yaml, ``_BASE_``, ``KEY VALUE``, :func:`load_cfg`,
  and the ways a cfg is written out (dump, flat, diff, ``--print-config``);
* :mod:`.validation`: :func:`validate_cfg`, one check per section;
* :mod:`.reference`: the Markdown reference of every key (``--help-config``).

The checks that read or write files before a run (OUT_DIR, weights, data) are
in :mod:`distribuuuu.preflight`.
"""

from distribuuuu.config.defaults import DEFAULTS, get_cfg
from distribuuuu.config.keys import (
    AUTO_AUGMENTS,
    BACKENDS,
    CHOICES,
    DATA_NAMES,
    DEVICES,
    DIST_MODES,
    LR_POLICIES,
    MAX_INIT_TIMEOUT,
    OPTIMIZERS,
    PRECISIONS,
    STRATEGIES,
)
from distribuuuu.config.loading import (
    MAX_YAML_BYTES,
    MAX_YAML_DEPTH,
    MAX_YAML_NODES,
    diff_from_defaults,
    dump_cfg,
    flat_cfg,
    format_cfg,
    load_cfg,
    merge_cfg,
    merge_from_file,
    merge_from_list,
    merge_resolved,
    parse_yaml,
)
from distribuuuu.config.reference import describe_keys, format_config_reference
from distribuuuu.config.validation import resolve_data_name, validate_cfg
from distribuuuu.errors import ConfigError

__all__ = [
    "AUTO_AUGMENTS",
    "BACKENDS",
    "CHOICES",
    "DATA_NAMES",
    "DEFAULTS",
    "DEVICES",
    "DIST_MODES",
    "LR_POLICIES",
    "MAX_INIT_TIMEOUT",
    "MAX_YAML_BYTES",
    "MAX_YAML_DEPTH",
    "MAX_YAML_NODES",
    "OPTIMIZERS",
    "PRECISIONS",
    "STRATEGIES",
    "ConfigError",
    "describe_keys",
    "diff_from_defaults",
    "dump_cfg",
    "flat_cfg",
    "format_cfg",
    "format_config_reference",
    "get_cfg",
    "load_cfg",
    "merge_cfg",
    "merge_from_file",
    "merge_from_list",
    "merge_resolved",
    "parse_yaml",
    "resolve_data_name",
    "validate_cfg",
]
