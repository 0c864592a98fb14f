"""The config tree: defaults, merge order, _BASE_, validation and CLI errors."""

from __future__ import annotations

import re
import warnings

import pytest
import yaml
from helpers import REPO, assert_ok, read_text, train_net
from yacs.config import CfgNode

from distribuuuu.config import describe_keys, format_config_reference, get_cfg, load_cfg
from distribuuuu.errors import ConfigError
from distribuuuu.preflight import load_checked_cfg
from distribuuuu.tools.train_net import main as train_net_main
from distribuuuu.tools.update_config_reference import COMMAND, PAGE, reference_page


def test_get_cfg_returns_a_fresh_clone():
    first = get_cfg()
    first.OPTIM.BASE_LR = 123.0
    assert get_cfg().OPTIM.BASE_LR != 123.0


def test_compatibility_keys_exist():
    cfg = get_cfg()
    keys = {
        "MODEL": "ARCH NUM_CLASSES PRETRAINED SYNCBN WEIGHTS DUMMY_INPUT",
        "TRAIN": "BATCH_SIZE IM_SIZE DATASET SPLIT AUTO_RESUME LOAD_OPT WORKERS "
        "PIN_MEMORY PRINT_FREQ TOPK",
        "TEST": "DATASET SPLIT BATCH_SIZE IM_SIZE PRINT_FREQ",
        "CUDNN": "BENCHMARK DETERMINISTIC",
        "OPTIM": "MAX_EPOCH LR_POLICY BASE_LR MIN_LR STEPS LR_MULT MOMENTUM DAMPENING "
        "NESTEROV WARMUP_FACTOR WARMUP_EPOCHS WEIGHT_DECAY",
    }
    for section, names in keys.items():
        for name in names.split():
            assert name in cfg[section], f"{section}.{name}"
    for name in ("OUT_DIR", "CFG_DEST", "RNG_SEED"):
        assert name in cfg


def test_every_default_has_a_comment():
    source = read_text(REPO, "distribuuuu", "config", "defaults.py").splitlines()
    for index, line in enumerate(source):
        if line.startswith("_C.") and " = " in line and "CfgNode()" not in line:
            assert source[index - 1].startswith("#"), f"no comment above: {line}"


def test_merge_order_base_file_then_overrides(tmp_path):
    (tmp_path / "base.yaml").write_text("OPTIM:\n  BASE_LR: 0.5\n  MAX_EPOCH: 7\n")
    (tmp_path / "child.yaml").write_text("_BASE_: base.yaml\nOPTIM:\n  BASE_LR: 0.3\n")
    cfg = load_cfg(str(tmp_path / "child.yaml"), ["OPTIM.MAX_EPOCH", "3"])
    assert cfg.OPTIM.BASE_LR == 0.3  # file beats _BASE_
    assert cfg.OPTIM.MAX_EPOCH == 3  # override beats both
    assert cfg.is_frozen()


def test_auto_data_name_resolves(tmp_path):
    assert load_cfg().DATA.NAME == "mnist5k"
    (tmp_path / "train").mkdir()
    (tmp_path / "val").mkdir()
    cfg = load_cfg(
        None, ["TRAIN.DATASET", str(tmp_path), "TEST.DATASET", str(tmp_path)]
    )
    assert cfg.DATA.NAME == "imagefolder"
    cfg = load_cfg(None, ["TRAIN.DATASET", str(tmp_path), "MODEL.DUMMY_INPUT", "True"])
    assert cfg.DATA.NAME == "synthetic"


def test_types_are_coerced_and_checked():
    cfg = load_cfg(None, ["OPTIM.BASE_LR", "1", "OUT_DIR", "2024", "RNG_SEED", "None"])
    assert cfg.OPTIM.BASE_LR == 1.0 and isinstance(cfg.OPTIM.BASE_LR, float)
    assert cfg.OUT_DIR == "2024"
    assert cfg.RNG_SEED is None
    cfg = load_cfg(None, ["OPTIM.STEPS", "[3, 6]", "OPTIM.LR_POLICY", "steps"])
    assert cfg.OPTIM.STEPS == [3, 6]


def test_original_full_recipe_dump_loads(tmp_path):
    # The original Distribuuuu recipes list every key, nulls included.
    data_dir = tmp_path / "ILSVRC"
    (data_dir / "train").mkdir(parents=True)
    (data_dir / "val").mkdir()
    recipe = tmp_path / "orig.yaml"
    recipe.write_text(
        "CFG_DEST: config.yaml\nCUDNN:\n  BENCHMARK: true\n  DETERMINISTIC: false\n"
        "MODEL:\n  ARCH: resnet18\n  DUMMY_INPUT: false\n  NUM_CLASSES: 1000\n"
        "  PRETRAINED: false\n  SYNCBN: false\n  WEIGHTS: null\n"
        "OPTIM:\n  BASE_LR: 0.2\n  DAMPENING: 0.0\n  LR_MULT: 0.1\n"
        "  LR_POLICY: cos\n  MAX_EPOCH: 100\n"
        "  MIN_LR: 0.0\n  MOMENTUM: 0.9\n  NESTEROV: true\n  STEPS: []\n"
        "  WARMUP_EPOCHS: 5\n  WARMUP_FACTOR: 0.1\n  WEIGHT_DECAY: 5.0e-05\n"
        "OUT_DIR: ./exp\nRNG_SEED: null\nTEST:\n  BATCH_SIZE: 200\n"
        f"  DATASET: {data_dir}\n  IM_SIZE: 256\n  PRINT_FREQ: 10\n  SPLIT: val\n"
        f"TRAIN:\n  AUTO_RESUME: true\n  BATCH_SIZE: 32\n  DATASET: {data_dir}\n"
        "  IM_SIZE: 224\n  LOAD_OPT: true\n  PIN_MEMORY: true\n  PRINT_FREQ: 30\n"
        "  SPLIT: train\n  TOPK: 5\n  WORKERS: 4\n"
    )
    cfg = load_cfg(str(recipe))
    assert cfg.DATA.NAME == "imagefolder"
    assert cfg.OPTIM.WARMUP_EPOCHS == 5.0 and cfg.RNG_SEED is None


@pytest.mark.parametrize(
    "opts, words",
    [
        (["OPTIM.NO_SUCH_KEY", "1"], ["unknown config key OPTIM.NO_SUCH_KEY"]),
        (["OPTIM.BASE_LRR", "1"], ["OPTIM.BASE_LRR", "did you mean OPTIM.BASE_LR?"]),
        (["OPTIM.BASE_LR", "abc"], ["OPTIM.BASE_LR", "expected a number", "'abc'"]),
        (["MODEL.ARCH", "nosuchnet"], ["MODEL.ARCH", "'nosuchnet'", "choose one of"]),
        (["MODEL.ARCH", "resnet181"], ["did you mean resnet18"]),
        (["TRAIN.BATCH_SIZE", "0"], ["TRAIN.BATCH_SIZE", "must be >= 1"]),
        (["OPTIM.LR_POLICY", "lin"], ["OPTIM.LR_POLICY", "cos, steps, exp"]),
        (["OPTIM.BASE_LR", "[1, 2]"], ["OPTIM.BASE_LR", "expected a number"]),
        (
            ["OPTIM.STEPS", "[5, 2]", "OPTIM.MAX_EPOCH", "9"],
            ["OPTIM.STEPS", "increasing"],
        ),
        (["TEST.IM_SIZE", "20"], ["TEST.IM_SIZE 20", "the evaluation crop 28"]),
        (["MODEL.NUM_CLASSES", "5"], ["mnist5k has 10 classes"]),
        (["OPTIM.MAX_EPOCH"], ["KEY VALUE pairs"]),
        (["LOG.STRAGGLER_RATIO", "1"], ["LOG.STRAGGLER_RATIO", "> 1, or 0 = off"]),
        (["LOG.STRAGGLER_RATIO", "-2"], ["LOG.STRAGGLER_RATIO", "> 1, or 0 = off"]),
        (
            ["DATA.SAMPLER", "fair"],
            ["DATA.SAMPLER 'fair'", "random, balanced, sqrt, repeat_factor"],
        ),
        (["DATA.REPEAT_THRESHOLD", "0"], ["DATA.REPEAT_THRESHOLD", "(0, 1]"]),
        (
            ["DATA.NAME", "webdataset", "DATA.SAMPLER", "sqrt"],
            ["DATA.SAMPLER 'sqrt'", "webdataset", "only random"],
        ),
    ],
)
def test_bad_values_raise_one_clear_line(opts, words):
    with pytest.raises(ConfigError) as info:
        load_checked_cfg(None, opts)
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message


def test_missing_dataset_directory(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(ConfigError, match="no such directory .*nope"):
        load_cfg(None, ["TRAIN.DATASET", missing])


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, words",
    [
        (["OPTIM.NO_SUCH_KEY", "1"], ["OPTIM.NO_SUCH_KEY"]),
        (["TRAIN.BATCH_SIZ", "8"], ["did you mean TRAIN.BATCH_SIZE?"]),
        (["OPTIM.BASE_LR", "fast"], ["OPTIM.BASE_LR", "'fast'"]),
        (["MODEL.ARCH", "nosuchnet"], ["MODEL.ARCH", "'nosuchnet'"]),
        (["--cfg", "config/no_such_file.yaml"], ["no_such_file.yaml", "no such file"]),
        (["TRAIN.DATASET", "/no/such/imagenet"], ["/no/such/imagenet"]),
        (["DATA.SAMPLER", "fair"], ["DATA.SAMPLER 'fair'", "random, balanced, sqrt"]),
    ],
)
def test_cli_bad_input_exits_2_with_one_error_line(tmp_path, args, words):
    out_dir = tmp_path / "out"
    result = train_net(*args, "OUT_DIR", str(out_dir), timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    for word in words:
        assert word in lines[0]
    assert not out_dir.exists()


# --------------------------------------------------------------------------- #
# The config reference (--help-config, docs/config-reference.md), --print-config
# --------------------------------------------------------------------------- #


def _leaves(node: dict, prefix: str = "") -> dict:
    """``{dotted key: value}`` for every key of a cfg tree."""
    leaves = {}
    for name, value in node.items():
        if isinstance(value, dict):
            leaves.update(_leaves(value, f"{prefix}{name}."))
        else:
            leaves[prefix + name] = value
    return leaves


@pytest.mark.slow
def test_help_config_lists_every_key_with_its_default_and_comment():
    result = train_net("--help-config", timeout=60)
    assert_ok(result)
    assert result.stdout == format_config_reference()
    listed = re.findall(r"^- `([\w.]+)` = `([^`]*)`: ", result.stdout, re.MULTILINE)
    defaults = _leaves(get_cfg())
    assert [key for key, _ in listed] == list(defaults)
    for key, value in listed:
        assert yaml.safe_load(value) == defaults[key], key
    text = " ".join(result.stdout.split())
    assert "Number of output classes (size of the classifier head)." in text
    assert "Choices: `auto`, `cpu`, `cuda`." in text


def test_docs_config_reference_matches_help_config():
    page = read_text(REPO, PAGE)
    expected = reference_page(format_config_reference())
    assert page == expected, f"{PAGE} is stale; run {COMMAND}"


_SOURCE = """
_C.MODEL = CfgNode()
# Architecture name
# (from the registry)
_C.MODEL.ARCH = "resnet20"
# ---------------------------------------------------------------------------- #
# Misc
# ---------------------------------------------------------------------------- #
_C.RNG_SEED = 1
"""


def test_a_key_without_a_comment_is_refused():
    model = CfgNode({"ARCH": "resnet20"})
    assert describe_keys(CfgNode({"MODEL": model}), _SOURCE) == [
        ("MODEL.ARCH", "resnet20", "Architecture name (from the registry)")
    ]
    with pytest.raises(ValueError, match=r"RNG_SEED has no comment"):  # a banner
        describe_keys(CfgNode({"MODEL": model, "RNG_SEED": 1}), _SOURCE)
    with pytest.raises(ValueError, match=r"DEVICE has no comment"):  # no line
        describe_keys(CfgNode({"MODEL": model, "DEVICE": "cpu"}), _SOURCE)


def test_print_config_prints_the_merged_yaml_and_writes_nothing(tmp_path, capsys):
    out_dir = tmp_path / "never"
    opts = ["OPTIM.BASE_LR", "0.2", "OUT_DIR", str(out_dir)]
    assert train_net_main(["--print-config", *opts]) == 0
    printed = capsys.readouterr().out
    assert yaml.safe_load(printed) == load_cfg(None, opts)
    assert "  BASE_LR: 0.2  # default: 0.1\n" in printed
    assert f"OUT_DIR: {out_dir}  # default: ./exp\n" in printed
    assert "  MAX_EPOCH: 10\n" in printed  # an unchanged key is not marked
    assert not out_dir.exists()


def test_deprecated_dist_mode_dp_becomes_strategy_dp_with_one_warning():
    with pytest.warns(FutureWarning, match="DIST.STRATEGY dp") as caught:
        cfg = load_cfg(None, ["DIST.MODE", "dp"])
    assert len(caught) == 1
    assert (cfg.DIST.STRATEGY, cfg.DIST.MODE) == ("dp", "ddp")
    # The dump says it the new way: loading it again does not warn.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = load_cfg(None, ["DIST.STRATEGY", cfg.DIST.STRATEGY])
    assert again.DIST.STRATEGY == "dp"
    with pytest.raises(ConfigError, match="DIST.MODE dp"):
        load_cfg(None, ["DIST.MODE", "dp", "DIST.STRATEGY", "fsdp"])
