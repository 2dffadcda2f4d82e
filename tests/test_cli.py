"""The `eagleray` command: every subcommand listed and reachable, a check's verdict in the exit status."""
import importlib
import subprocess
import sys

import pytest

from infer import cli

NAMES = ["pipeline", "train", "eval", "serve", "convert-head", "check-lossless", "check-vllm", "gguf-to-hf",
         "cluster", "config-doc"]


def test_help_lists_every_command_and_loads_no_torch():
    code = ("import sys; from infer import cli; cli.main(['--help']); "
            "print('torch' in sys.modules, 'ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    for name in NAMES:
        assert f"  {name} " in out, name
    assert out.strip().splitlines()[-1] == "False False"


@pytest.mark.parametrize("name", NAMES)
def test_each_command_has_a_main(name):
    assert callable(importlib.import_module(cli.ALL[name][0]).main)


def test_unknown_command_is_refused_with_the_list(capsys):
    assert cli.main(["nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'nope'" in err and "check-vllm" in err


@pytest.mark.parametrize("name", ["convert-head", "check-lossless", "check-vllm", "gguf-to-hf", "cluster"])
def test_subcommand_help_exits_zero(name):
    with pytest.raises(SystemExit) as e:
        cli.main([name, "--help"])
    assert e.value.code == 0


def test_exit_code_follows_the_checks_verdict():
    assert cli.exit_code({"ok": True, "tau": 2.0}) == 0
    assert cli.exit_code({"ok": False}) == 1
    assert cli.exit_code({"ok": {"speculators": True, "sglang": False}}) == 1
    assert cli.exit_code({"ok": {"speculators": True}}) == 0
    assert cli.exit_code({"rows": 3}) == 0 and cli.exit_code(3) == 3
