"""What the docs show keeps working: every command line and config key that the
README showed before it moved into docs/ (issue 34) still parses and loads,
without training anything."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import re
import shlex
from pathlib import Path
from unittest import mock

import pytest

from distribuuuu.config import ConfigError, get_cfg, merge_cfg
from distribuuuu.config.keys import RENAMED

REPO = Path(__file__).resolve().parent.parent

# --------------------------------------------------------------------------- #
# Command lines
# --------------------------------------------------------------------------- #

# Every command line of README.md's code blocks, of its launch table and the
# whole ones of its text, as they stood at commit 80fb86d (before the README
# moved into docs/): continuation lines joined, comments and alignment dropped.
# Kept here as data, so that a command the docs stop showing is still checked.
COMMANDS = [
    # The first of the two commands at the top.
    "python3 -m venv .venv && .venv/bin/pip install -e . && "
    ".venv/bin/python tools/train_net.py",
    # Configuration.
    "python tools/train_net.py --cfg config/resnet18.yaml OUT_DIR /tmp/r18 "
    "TRAIN.BATCH_SIZE 64 OPTIM.BASE_LR 0.4",
    "python tools/train_net.py OPTIM.MAX_EPOCH 3 MODEL.ARCH resnet8",
    "python tools/train_net.py --eval-only OUT_DIR ./exp",
    "python tools/train_net.py --eval-only MODEL.WEIGHTS path/to/ckpt.pth",
    "python tools/train_net.py --cfg config/resnet50.yaml --print-config",
    "python tools/train_net.py --cfg config/resnet50.yaml --dry-run",
    "python tools/train_net.py --help-config",
    # Data: the GPU decoder, shards.
    "python tools/train_net.py --cfg config/resnet50.yaml DATA.DECODER gpu "
    "TRAIN.DATASET /data/imagenet TEST.DATASET /data/imagenet",
    "distribuuuu-shards /data/imagenet /data/shards --samples 1000 --max-side 256 "
    "--quality 90",
    "torchrun --nproc_per_node=8 tools/train_net.py --cfg config/X.yaml "
    "DATA.NAME webdataset TRAIN.DATASET '/data/shards/train-{000000..001281}.tar' "
    "TEST.DATASET '/data/shards/val-{000000..000049}.tar'",
    # Launching: the table.
    "python tools/train_net.py --cfg config/resnet18.yaml",
    "torchrun --standalone --nproc_per_node=8 tools/train_net.py "
    "--cfg config/resnet18.yaml",
    "python -m torch.distributed.launch --nproc_per_node=8 tools/train_net.py "
    "--cfg config/resnet18.yaml",
    "python tools/train_net.py --num-procs 8 --cfg config/resnet18.yaml",
    "python tools/train_net.py --cfg config/resnet18.yaml DIST.STRATEGY dp "
    "TRAIN.BATCH_SIZE 256",
    "torchrun --nnodes=2 --node_rank=$NODE_RANK --nproc_per_node=8 "
    "--master_addr=$HEAD --master_port=29500 tools/train_net.py "
    "--cfg config/resnet50.yaml",
    "srun -N 8 --ntasks-per-node=8 --gres=gpu:8 python -u tools/train_net.py "
    "--cfg config/resnet50.yaml",
    "sbatch --nodes=8 tools/slurm_train.sh --cfg config/resnet50.yaml "
    "OUT_DIR ./exp/r50",
    # Launching: the original Distribuuuu cluster command.
    "srun --partition=gpu -n 64 --gres=gpu:8 --ntasks-per-node=8 --job-name=r50 "
    "python -u tools/train_net.py --cfg config/resnet50.yaml "
    "TRAIN.BATCH_SIZE 128 OUT_DIR ./exp/r50 OPTIM.BASE_LR 6.4",
    # Strategies: tensor and pipeline parallelism, DeepSpeed, the bubble.
    "torchrun --nproc_per_node=4 tools/train_net.py --cfg config/digits_vit_tiny.yaml "
    "DIST.TENSOR_PARALLEL 2 DIST.STRATEGY fsdp",
    "torchrun --nproc_per_node=4 tools/train_net.py MODEL.ARCH resnet20 "
    "DIST.STRATEGY pipeline DIST.PIPELINE.STAGES 2 DIST.PIPELINE.SCHEDULE 1f1b "
    "DIST.PIPELINE.MICROBATCHES 4",
    "torchrun --nproc_per_node=2 tools/train_net.py DIST.STRATEGY deepspeed "
    "DIST.DEEPSPEED.ZERO_STAGE 3 DIST.DEEPSPEED.OFFLOAD_OPTIMIZER cpu",
    "deepspeed --num_gpus 2 tools/train_net.py DIST.STRATEGY deepspeed",
    "python tools/benchmark.py --only pipeline",
    # Trackers.
    "train_net.py --cfg config/resnet18.yaml OUT_DIR /exp/r18 "
    "LOG.TRACKERS \"['tensorboard','mlflow']\" "
    "LOG.MLFLOW.TRACKING_URI http://mlflow.example:5000 LOG.MLFLOW.EXPERIMENT r18",
    "WANDB_MODE=offline train_net.py OUT_DIR /exp/r18 "
    "LOG.TRACKERS \"['wandb','csv']\" LOG.WANDB.PROJECT imagenet",
    # Inspect, export, predict, average.
    "python tools/inspect_ckpt.py exp/checkpoints/ckpt_ep_0010.pth",
    "python tools/export.py --weights exp/best.pth --out r20.pth "
    "--torchscript r20.ts --torch-export r20.pt2",
    "python tools/predict.py --weights exp/best.pth --topk 3 photos/ a.png",
    "python tools/export.py --weights exp/best.pth --onnx r20.onnx",
    "python tools/predict.py --onnx r20.onnx photos/",
    "python tools/average_checkpoints.py --out avg.pth --run exp --best 3",
    # The GPU check.
    "tools/gpu_check.sh --fetch-wheels",
    "tools/gpu_check.sh --dry-run",
    'tools/gpu_check.sh --out "$OUT"',
    # Performance and profiling.
    "python tools/benchmark.py --model resnet18 --im-size 32 --batch 64 "
    "--threads 1 --no-channels-last",
    "python tools/benchmark.py --threads 1 --only train [--no-channels-last]",
    "python tools/benchmark.py --only data",
    "python tools/benchmark.py --threads 1 --only train,startup,stop",
    "python tools/benchmark.py --short",
    "python tools/train_net.py --cfg X.yaml TRAIN.PROFILE_STEPS 5",
    # The config reference.
    "python tools/update_config_reference.py",
]

# What the placeholders of those commands stand for here.
PLACEHOLDERS = {
    "config/X.yaml": "config/resnet50.yaml",  # "any recipe"
    "X.yaml": "config/mnist5k.yaml",
    "$NODE_RANK": "0",
    "$HEAD": "10.0.0.1",
    '"$OUT"': "/tmp/gpu_check",
    "[--no-channels-last]": "--no-channels-last",  # an optional flag: given
}

# Console scripts (setup.py) the commands call by name: the tool module of each.
CONSOLE_SCRIPTS = {"distribuuuu-shards": "make_shards"}
PYTHONS = ("python", "python3", ".venv/bin/python")


@contextlib.contextmanager
def no_abbreviations():
    """Every argparse parser made meanwhile refuses abbreviated flags, so that a
    renamed flag (``--max-side`` to ``--max-side-px``) fails to parse instead of
    being taken as the prefix of the new one."""
    init = argparse.ArgumentParser.__init__

    def strict_init(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        init(self, *args, **kwargs)

    with mock.patch.object(argparse.ArgumentParser, "__init__", strict_init):
        yield


def parse(parse_args, argv: list[str]):
    """``parse_args(argv)``; an AssertionError naming ``argv`` when refused."""
    try:
        return parse_args(argv)
    except SystemExit:  # argparse printed why on stderr
        raise AssertionError(f"the parser refused {shlex.join(argv)}") from None


def words_of(command: str) -> list[str]:
    """``command``'s words, placeholders filled in, leading ``VAR=value`` dropped."""
    for name, value in PLACEHOLDERS.items():
        command = command.replace(name, value)
    words = shlex.split(command, comments=True)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words.pop(0)
    return words


def check_command(command: str, sandbox: Path) -> None:
    """Parse ``command`` as the program it starts would, and load its config.

    Raises AssertionError (or ConfigError) when something it uses is gone.
    """
    with no_abbreviations():
        for part in command.split(" && "):
            words = words_of(part)
            if words[1:3] == ["-m", "venv"] or words[0].endswith("/pip"):
                continue  # setting up the venv
            check_words(words, sandbox)


def check_words(words: list[str], sandbox: Path) -> None:
    """Check one command's words (see :func:`check_command`)."""
    head, rest = words[0], words[1:]
    if head in PYTHONS:
        rest = rest[1:] if rest[:1] == ["-u"] else rest
        if rest[:2] == ["-m", "torch.distributed.launch"]:
            from torch.distributed import launch

            args = parse(launch.parse_args, rest[2:])
            check_script(args.training_script, args.training_script_args, sandbox)
        else:
            check_script(rest[0], rest[1:], sandbox)
    elif head == "torchrun":
        from torch.distributed.run import get_args_parser

        args = parse(get_args_parser().parse_args, rest)
        check_script(args.training_script, args.training_script_args, sandbox)
    elif head in ("srun", "deepspeed"):  # their own flags are theirs to check
        at = next(i for i, word in enumerate(rest) if word.endswith("train_net.py"))
        check_script(rest[at], rest[at + 1 :], sandbox)
    elif head == "sbatch":
        at = rest.index("tools/slurm_train.sh")
        script = (REPO / "tools" / "slurm_train.sh").read_text(encoding="utf-8")
        assert 'tools/train_net.py "$@"' in script, "slurm_train.sh forwards its args"
        check_train(rest[at + 1 :], sandbox)
    elif head in CONSOLE_SCRIPTS:
        module = CONSOLE_SCRIPTS[head]
        setup = (REPO / "setup.py").read_text(encoding="utf-8")
        assert f'"{head}=distribuuuu.tools.{module}:main"' in setup, head
        check_tool(module, rest)
    else:
        check_script(head, rest, sandbox)


def check_script(path: str, argv: list[str], sandbox: Path) -> None:
    """Check ``path argv``, ``path`` one of tools/ (``train_net.py`` alone too)."""
    name = os.path.basename(path)
    assert (REPO / "tools" / name).is_file(), f"no tools/{name}"
    if name == "gpu_check.sh" and argv[:1] == ["--fetch-wheels"]:
        script = (REPO / "tools" / name).read_text(encoding="utf-8")
        assert '"--fetch-wheels"' in script and 'gpu_wheels.py fetch "$@"' in script
        check_tool("gpu_wheels", ["fetch", *argv[1:]], parse_args=False)
    elif name == "gpu_check.sh":
        check_tool("gpu_check", argv)
    elif name == "train_net.py":
        check_train(argv, sandbox)
    else:
        assert name.endswith(".py"), name
        check_tool(name[: -len(".py")], argv)


def check_tool(module: str, argv: list[str], parse_args: bool = True) -> None:
    """The tool's argument parser takes ``argv``: its ``parse_args``, or for a
    tool that parses inside ``main`` (gpu_wheels), the words of its --help."""
    tool = importlib.import_module(f"distribuuuu.tools.{module}")
    if parse_args:
        parse(tool.parse_args, argv)
        return
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        tool.main(["--help"])
    for word in argv:
        assert word in out.getvalue(), f"{module} --help lacks {word}"


def check_train(argv: list[str], sandbox: Path) -> None:
    """train_net.py's parser takes ``argv``, and ``train_net.py --print-config``
    accepts its config, with the folders and files it names stood in for by
    empty ones in ``sandbox`` (the pre-flight checks, which read them, and the
    run are not started)."""
    from distribuuuu.tools import train_net

    args = parse(train_net.parse_args, argv)
    if args.help_config:
        return
    cfg_file = str(REPO / args.cfg_file) if args.cfg_file else None
    cfg = merge_cfg(cfg_file, args.opts)
    stand_ins = []
    for section in ("TRAIN", "TEST"):
        node = cfg[section]
        if node.DATASET and "{" not in node.DATASET:  # a folder, not shards
            root = sandbox / node.DATASET.lstrip("/")
            (root / node.SPLIT).mkdir(parents=True, exist_ok=True)
            stand_ins += [f"{section}.DATASET", str(root)]
    if cfg.MODEL.WEIGHTS:
        weights = sandbox / cfg.MODEL.WEIGHTS.lstrip("/")
        weights.parent.mkdir(parents=True, exist_ok=True)
        weights.touch()
        stand_ins += ["MODEL.WEIGHTS", str(weights)]
    given = ["--cfg", cfg_file] if cfg_file else []
    code, _, err = run_main(
        train_net.main, ["--print-config", *given, *args.opts, *stand_ins]
    )
    assert code == 0, f"train_net.py --print-config refused it: {err}"


def run_main(main, argv: list[str]) -> tuple[int, str, str]:
    """``main(argv)`` in this process: its exit code, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_the_docs_showed_still_parses_and_loads(command, tmp_path):
    check_command(command, tmp_path)


@pytest.mark.parametrize(
    "command",
    [
        "distribuuuu-shards /data/imagenet /data/shards --samples 1000 --max-sid 256",
        "python tools/export.py --weights exp/best.pth --torch-exp r20.pt2",
        "python tools/train_net.py --print-conf",
        "python tools/train_net.py TRAIN.BATCH_SIZ 64",
        "torchrun --nproc_per_nod=8 tools/train_net.py",
        "python tools/no_such_tool.py --help",
        "tools/gpu_check.sh --dry-runs",
    ],
)
def test_the_command_check_fails_on_a_renamed_flag_or_key(command, tmp_path):
    with pytest.raises((AssertionError, ConfigError)):
        check_command(command, tmp_path)


# --------------------------------------------------------------------------- #
# Config keys
# --------------------------------------------------------------------------- #

# Every config key the README named at commit 80fb86d outside its generated
# reference (dotted in the text, or a section's keys in its table), by section
# ("": the top level).
KEYS_BY_SECTION = {
    "": "CFG_DEST DEVICE OUT_DIR RNG_SEED",
    "CHECKPOINT": "BEST_METRIC KEEP KEEP_BEST PERIOD PERIOD_ITERS",
    "CUDNN": "BENCHMARK DETERMINISTIC",
    "DATA": (
        "AUTO_AUGMENT DECODER DOWNLOAD NAME RANDAUG_M RANDAUG_N RANDOM_ERASING "
        "REPEATED_AUG SHUFFLE_BUFFER SKIP_CORRUPT SYNTHETIC_SIZE TIMEOUT"
    ),
    "DIST": (
        "BACKEND DEEPSPEED FSDP_CPU_OFFLOAD INIT_TIMEOUT MODE PIPELINE REQUEUE "
        "SEQUENCE_PARALLEL STOP_CHECK_STEPS STRATEGY TENSOR_PARALLEL"
    ),
    "DIST.DEEPSPEED": "CONFIG NVME_PATH OFFLOAD_OPTIMIZER OFFLOAD_PARAMS ZERO_STAGE",
    "DIST.PIPELINE": "MICROBATCHES SCHEDULE SPLIT STAGES VIRTUAL_STAGES",
    "LOG": "CLOSE_TIMEOUT TRACKERS",
    "LOG.MLFLOW": "EXPERIMENT RUN_NAME TRACKING_URI UPLOAD_BEST",
    "LOG.WANDB": "ENTITY MODE PROJECT RUN_NAME UPLOAD_BEST",
    "MODEL": (
        "ACT_CKPT ARCH BN_EPS BN_MOMENTUM CHANNELS_LAST COMPILE COMPILE_MODE "
        "DROPOUT DROP_PATH DUMMY_INPUT EMA EMA_DECAY EMA_EVERY EMA_WARMUP FINETUNE "
        "NUM_CLASSES PRETRAINED SYNCBN WEIGHTS ZERO_INIT_RESIDUAL"
    ),
    "OPTIM": (
        "BASE_LR BETAS CLIP_GRAD_NORM DAMPENING EPS LARS_ETA LAYER_DECAY LR_MULT "
        "LR_POLICY LR_STEP MAX_EPOCH MIN_LR MOMENTUM NESTEROV NO_DECAY_NORM_BIAS "
        "OPTIMIZER REFERENCE_BATCH RMSPROP_ALPHA STEPS WARMUP_EPOCHS WARMUP_FACTOR "
        "WEIGHT_DECAY"
    ),
    "TEST": (
        "BATCH_SIZE CROP_PCT CROP_SIZE DATASET IM_SIZE INTERPOLATION PRINT_FREQ "
        "SPLIT TTA"
    ),
    "TRAIN": (
        "ACCUM_STEPS AUTO_RESUME BATCH_SIZE CUTMIX_ALPHA DATASET DATA_BOUND_SHARE "
        "HFLIP IM_SIZE INTERPOLATION LABEL_SMOOTHING LOAD_OPT MIXED_PRECISION "
        "MIXUP_ALPHA MIX_PROB MIX_SWITCH_PROB PIN_MEMORY PRECISE_BN PRINT_FREQ "
        "PROFILE_STEPS RESUME_BATCH SINGLE_PROCESS_IMG_PER_S SPLIT TOPK WORKERS"
    ),
    "TRAIN.DISTILL": "ALPHA ARCH TAU TYPE WEIGHTS",
}
KEYS = [
    f"{section}.{name}".lstrip(".")
    for section, names in KEYS_BY_SECTION.items()
    for name in names.split()
]


def is_config_key(key: str) -> bool:
    """``key`` names a key or section of the defaults, or a renamed key."""
    node = get_cfg()
    for name in key.split("."):
        if not hasattr(node, "keys") or name not in node:
            return key in RENAMED
        node = node[name]
    return True


def test_every_config_key_the_docs_named_exists():
    missing = [key for key in KEYS if not is_config_key(key)]
    assert not missing, f"config keys the docs name but the defaults lack: {missing}"


def test_the_key_check_fails_on_a_missing_key():
    assert is_config_key("TRAIN.PRINT_FEQ")  # renamed, still taken
    assert not is_config_key("TRAIN.BATCH_SIZ")
    assert not is_config_key("MODEL.ARCH.NAME")
    assert not is_config_key("NO_SUCH_SECTION.KEY")


# The error lines the README showed for a bad key or value ("..." elides).
ERROR_LINES = {
    "TRAIN.BATCH_SIZ 64": "unknown config key TRAIN.BATCH_SIZ; did you mean "
    "TRAIN.BATCH_SIZE?",
    "OPTIM.BASE_LR fast": "OPTIM.BASE_LR: expected a number, got 'fast'",
    "MODEL.ARCH resnet181": "MODEL.ARCH 'resnet181' is invalid: choose one of "
    "...; did you mean resnet18?",
}


@pytest.mark.parametrize("opts", ERROR_LINES)
def test_the_error_lines_the_docs_show_are_the_errors_given(opts):
    from distribuuuu.tools import train_net

    code, _, err = run_main(train_net.main, ["--print-config", *opts.split()])
    pattern = ".*".join(re.escape(part) for part in ERROR_LINES[opts].split("..."))
    assert code == 2 and re.fullmatch(f"error: {pattern}\n", err), err


def test_every_config_key_the_docs_name_now_exists():
    """The dotted keys in today's README.md and docs/ (the generated reference
    aside), beside the fixed list above."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    named = set()
    for page in pages:
        if page.name != "config-reference.md":
            named.update(DOTTED_KEY.findall(page.read_text(encoding="utf-8")))
    named -= set(MISSPELT_IN_THE_DOCS)
    missing = sorted(key for key in named if not is_config_key(key))
    assert not missing, f"config keys the docs name but the defaults lack: {missing}"
    assert "OPTIM.BASE_LR" in named  # the pattern finds keys


# A key written in the docs: MODEL.ARCH, TRAIN.DISTILL.TAU (not Image.MAX_...).
DOTTED_KEY = re.compile(r"(?<![\w.])([A-Z][A-Z0-9_]*(?:\.[A-Z][A-Z0-9_]*)+)(?![\w])")
# The misspelling the docs show in an error line on purpose.
MISSPELT_IN_THE_DOCS = ["TRAIN.BATCH_SIZ"]


# --------------------------------------------------------------------------- #
# Links
# --------------------------------------------------------------------------- #

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text: str) -> list[str]:
    """The lines of Markdown ``text`` outside fenced code blocks, with inline
    code spans kept as text (headings) but links inside them never read."""
    lines, fence = [], ""
    for line in text.splitlines():
        marker = re.match(r"^\s*(```+|~~~+)", line)
        if marker and (not fence or marker.group(1).startswith(fence)):
            fence = "" if fence else marker.group(1)[:3]
            continue
        if not fence:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text lowercased, punctuation but ``-``
    and ``_`` dropped, each space a ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a Markdown page; repeats get ``-1``, ``-2``, ..."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in prose_lines(text):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(page: Path) -> list[str]:
    """The relative links and ``#anchors`` of ``page`` that lead nowhere."""
    broken = []
    for line in prose_lines(page.read_text(encoding="utf-8")):
        line = re.sub(r"(`+)(?:(?!\1).)+\1", "", line)  # no links in code spans
        for target in LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            goal = (page.parent / path).resolve() if path else page
            if not goal.exists():
                broken.append(f"{target}: no such file")
            elif anchor and (
                goal.suffix != ".md"
                or anchor not in anchors(goal.read_text(encoding="utf-8"))
            ):
                broken.append(f"{target}: no such heading in {goal.name}")
    return broken


def test_every_link_in_the_docs_leads_somewhere():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    assert len(pages) > 10, "docs/ has its pages"
    broken = {
        str(page.relative_to(REPO)): links
        for page in pages
        if (links := broken_links(page))
    }
    assert not broken, f"links that lead nowhere: {broken}"


def test_the_link_check_follows_github_s_anchors_and_fails_on_a_broken_link(
    tmp_path,
):
    assert slug("Safety: untrusted files") == "safety-untrusted-files"
    assert slug("Tensorboard and `--eval-only`") == "tensorboard-and---eval-only"
    assert slug("The GPU check: `tools/gpu_check.sh`") == (
        "the-gpu-check-toolsgpu_checksh"
    )
    assert slug("See [Data](data.md) first") == "see-data-first"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n### A\n") == {
        "a",
        "a-1",
        "a-2",
    }
    (tmp_path / "other.md").write_text("# Other page\n\n## Part two\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Here\n\n"
        "[fine](other.md) [fine](other.md#part-two) [fine](#here) "
        "[web](https://example.com/x#y) `[code](nowhere.md)`\n"
        "[gone](missing.md) [no heading](other.md#part-three) [self](#there)\n"
        "```\n[in a block](nowhere.md)\n```\n"
    )
    assert broken_links(page) == [
        "missing.md: no such file",
        "other.md#part-three: no such heading in other.md",
        "#there: no such heading in page.md",
    ]
