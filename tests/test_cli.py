"""distribuuuu.cli: errors become exit codes and one ``error:`` line, in every tool.

The wrapper alone first, then a bad input to each of the four tools: in
process (the tool's ``main``) and as a user runs it (a new interpreter), where
no traceback may reach the terminal unless ``--debug`` asks for it.
"""

from __future__ import annotations

import importlib.util
import os
import signal
from pathlib import Path
from types import ModuleType

import pytest
import torch
from helpers import error_line, run_python

from distribuuuu import cli
from distribuuuu.errors import ConfigError
from distribuuuu.models import build_model

REPO = Path(__file__).resolve().parents[1]


def load_tool(name: str) -> ModuleType:
    """``tools/NAME.py`` of this checkout, imported from its file."""
    spec = importlib.util.spec_from_file_location(
        f"tool_{name}", REPO / "tools" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------- #
# The wrapper
# --------------------------------------------------------------------------- #


def _raise(error: BaseException):
    def work():
        raise error

    return work


def test_run_tool_returns_the_code_of_the_work():
    assert cli.run_tool(lambda: None) == 0
    assert cli.run_tool(lambda: 3) == 3


def test_the_first_matching_rule_decides_code_and_line(capsys):
    rules = (
        cli.ErrorExit(ConfigError, 2),
        cli.ErrorExit(ValueError, 5, lambda error: f"custom {error}"),
    )
    assert cli.run_tool(_raise(ConfigError("OUT_DIR bad")), rules=rules) == 2
    assert error_line(capsys) == "error: OUT_DIR bad"
    assert cli.run_tool(_raise(ValueError("x")), rules=rules) == 5
    assert error_line(capsys) == "error: custom x"


def test_other_errors_exit_1_and_ctrl_c_130(capsys):
    assert cli.run_tool(_raise(KeyError("k"))) == 1
    assert error_line(capsys) == "error: KeyError: 'k'"
    assert cli.run_tool(_raise(KeyboardInterrupt())) == 130
    assert error_line(capsys) == "error: interrupted"


def test_a_rule_may_compute_the_code_from_the_error(capsys):
    rules = (cli.ErrorExit(cli.StartupStop, lambda stop: 128 + stop.signum),)
    stop = cli.StartupStop(signal.SIGTERM)
    assert cli.run_tool(_raise(stop), rules=rules) == 128 + signal.SIGTERM
    assert error_line(capsys).startswith("error: ")


def test_a_long_error_line_is_cut_in_the_middle(capsys):
    """A message quoting a huge value (690,000 characters) prints one line of
    about 2000, its start and end kept; --debug's traceback keeps it whole."""
    message = "OPTIM.STEPS: " + "x" * 690_000 + " must increase"
    rules = (cli.ErrorExit(ConfigError, 2),)
    assert cli.run_tool(_raise(ConfigError(message)), rules=rules) == 2
    line = error_line(capsys)
    assert len(line) < 2100
    assert line.startswith("error: OPTIM.STEPS: xxx") and line.endswith("must increase")
    assert "characters cut]" in line
    assert cli.run_tool(_raise(ConfigError(message)), debug=True, rules=rules) == 2
    assert message in capsys.readouterr().err


def test_system_exit_passes_through():
    with pytest.raises(SystemExit):
        cli.run_tool(_raise(SystemExit(143)))


def test_debug_prints_the_traceback_before_the_line(capsys):
    assert cli.run_tool(_raise(RuntimeError("boom")), debug=True) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last)")
    assert err.strip().splitlines()[-1] == "error: RuntimeError: boom"


def test_only_rank_0_reports_unless_every_rank(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert cli.run_tool(_raise(RuntimeError("boom"))) == 1
    assert capsys.readouterr().err == ""
    rules = (cli.ErrorExit(RuntimeError, 1, every_rank=True),)
    assert cli.run_tool(_raise(RuntimeError("boom")), rules=rules) == 1
    assert error_line(capsys) == "error: RuntimeError: boom"


# --------------------------------------------------------------------------- #
# Each tool, in process
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def plain_weights(tmp_path_factory) -> Path:
    """A plain state_dict of the default architecture (resnet20), untrained."""
    path = tmp_path_factory.mktemp("weights") / "w.pth"
    torch.manual_seed(0)
    torch.save(build_model("resnet20", 10).state_dict(), path)
    return path


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> Path:
    """A 28 x 28 grey PNG."""
    from PIL import Image

    path = tmp_path_factory.mktemp("images") / "a.png"
    Image.new("L", (28, 28), color=128).save(path)
    return path


def test_train_net_bad_key_is_one_line(capsys, tmp_path):
    main = load_tool("train_net").main
    assert main(["TRAIN.BATCH_SIZ", "8", "OUT_DIR", str(tmp_path / "out")]) == 2
    assert "did you mean TRAIN.BATCH_SIZE?" in error_line(capsys)


def test_export_missing_weights_is_one_line(capsys, tmp_path):
    main = load_tool("export").main
    argv = ["--weights", str(tmp_path / "nope.pth"), "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    assert "no such file" in error_line(capsys)


def test_inspect_not_a_checkpoint_is_one_line(capsys, tmp_path):
    text = tmp_path / "notes.pth"
    text.write_text("not a checkpoint\n")
    assert load_tool("inspect_ckpt").main([str(text)]) == 2
    assert "not a checkpoint torch can read" in error_line(capsys)


def test_predict_unexpected_error_is_one_line(capsys, plain_weights, image):
    """A crop of 0 pixels fails inside torchvision: exit 1, not a traceback."""
    argv = ["--weights", str(plain_weights), "--device", "cpu"]
    assert load_tool("predict").main([*argv, "TRAIN.IM_SIZE", "0", str(image)]) == 1
    assert error_line(capsys).startswith("error: RuntimeError: ")


def test_predict_bad_input_is_one_line(capsys, plain_weights, tmp_path):
    argv = ["--weights", str(plain_weights), "--device", "cpu"]
    assert load_tool("predict").main([*argv, str(tmp_path / "none.png")]) == 2
    assert "no such file or folder" in error_line(capsys)


# --------------------------------------------------------------------------- #
# Each tool, as a user runs it
# --------------------------------------------------------------------------- #


def _tool_cases(weights: Path, image: Path, tmp: Path) -> dict:
    """name -> (argv of tools/NAME.py, exit code, words of the error line)."""
    text = tmp / "notes.pth"
    text.write_text("not a checkpoint\n")
    return {
        "train_net": (["MODEL.ARCH", "nosuchnet", "OUT_DIR", str(tmp / "o")], 2, []),
        "export": (
            ["--weights", str(text), "--out", str(tmp / "w.pth")],
            2,
            ["not a checkpoint"],
        ),
        "inspect_ckpt": ([str(tmp / "nope.pth")], 2, ["no such file"]),
        "predict": (
            ["--weights", str(weights), "--device", "cpu"]
            + ["TRAIN.IM_SIZE", "0", str(image)],
            1,
            ["RuntimeError"],
        ),
    }


@pytest.mark.slow
@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
@pytest.mark.parametrize("name", ["train_net", "export", "inspect_ckpt", "predict"])
def test_every_tool_ends_in_one_error_line(name, debug, plain_weights, image, tmp_path):
    argv, code, words = _tool_cases(plain_weights, image, tmp_path)[name]
    flags = ["--debug"] if debug else []
    result = run_python([str(REPO / "tools" / f"{name}.py"), *flags, *argv], 120)
    assert result.returncode == code, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: "), result.stderr
    assert all(word in lines[-1] for word in words), lines[-1]
    if debug:
        assert "Traceback (most recent call last)" in result.stderr
    else:
        assert "Traceback" not in result.stderr + result.stdout
    assert [line for line in lines if line.startswith("error: ")] == lines[-1:]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_stop_swallowed_during_start_up_stops_the_training_loop():
    """SIGTERM raised as StartupStop inside a __del__ (which Python prints and
    ignores, as an import's weakref callback) is not lost: the loop's
    StopRequest starts with it."""
    from distribuuuu.engine.loop import StopRequest

    class SignalledOnCollection:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)

    try:
        with cli.stop_signals_raise():
            SignalledOnCollection()  # collected at once: StartupStop swallowed
            stop = StopRequest()
            assert stop.agreed() == signal.SIGTERM and stop.stopping
    finally:
        cli.default_stop_signals()
