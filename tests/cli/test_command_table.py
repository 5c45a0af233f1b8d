"""The command table builds only the chosen command's arguments: every command line must
then parse exactly as with the whole table, and every command's function must exist."""

from __future__ import annotations

import argparse
import importlib

import pytest

from jupyter_gpu_snapshot.cli.main import COMMANDS, build_parser, chosen_command

LINES = [
    ["list"],
    ["--store", "list", "list", "--json"],
    ["--store=/tmp/s", "--criu", "rm", "rm", "x", "--where", "local"],
    ["--criu", "/usr/sbin/criu", "restore", "a-name", "--fallback", "replay", "--json"],
    ["agent", "--disk-quota", "2G", "--socket-mode", "0660"],
    ["kernelspec", "install", "--user"],
    ["save", "--pid", "7", "--name", "n", "--stop"],
    ["status", "--pid", "1"],
    ["hibernate", "k-1", "--tier", "gpu", "--url", "http://h/"],
    ["timeline", "k-1", "--json"],
    ["rewind", "/tmp/kernel-1.json", "--before", "3"],
]


@pytest.mark.parametrize("argv", LINES, ids=[" ".join(line) for line in LINES])
def test_a_line_parses_as_with_the_whole_table(argv: list[str]) -> None:
    chosen = build_parser(chosen_command(argv)).parse_args(argv)
    assert chosen == build_parser().parse_args(argv)


@pytest.mark.parametrize("argv", [["--help"], ["list", "--help"], ["nosuch"], [],
                                  ["rewind", "k-1", "--before", "0"], ["rewind", "k-1"]])
def test_help_and_refusals_stay_argparse_s(argv: list[str],
                                           capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as chosen:
        build_parser(chosen_command(argv)).parse_args(argv)
    told = capsys.readouterr()
    with pytest.raises(SystemExit) as whole:
        build_parser().parse_args(argv)
    assert chosen.value.code == whole.value.code
    assert told == capsys.readouterr()


def test_every_command_runs_a_function_of_the_package() -> None:
    for command in COMMANDS:
        module, function = command.runs.split(":")
        found = getattr(importlib.import_module(f"jupyter_gpu_snapshot.cli.{module}"), function)
        assert callable(found), command.name
        command.arguments(argparse.ArgumentParser())
