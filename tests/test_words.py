"""The project's two words one letter apart, as a user meets them: the help says "framework set-up" for
``--adaptor`` (a framework's set-up module) and "device adapter" for ``--adapter``; and a refused adapter file is
named as the user wrote it (``path/zeta.py:Zeta``), never by the module name portspeed imports the file under."""

from __future__ import annotations

import contextlib
import io
import re

import pytest

from portspeed import cli
from portspeed.cli.main import COMMANDS

pytestmark = pytest.mark.usefixtures("portspeed_env")  # tests/conftest.py: clean settings, selection forgotten

#: option -> the words its help must hold
WORDS = {"--adaptor": "framework set-up", "--adapter": "device adapter"}


def _help(command: str) -> str:
    """What ``portspeed COMMAND --help`` prints (stdout and stderr), on one very wide terminal."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            cli.main([command, "--help"])
        except SystemExit:  # argparse's own exit after printing the help
            pass
    return buf.getvalue()


def _option_entries(text: str) -> list[str]:
    """Each option's entry in an argparse help: its line and the indented lines that continue it, joined."""
    entries: list[str] = []
    inside = False
    for line in text.splitlines():
        if line.startswith("  -"):
            entries.append(line.strip())
            inside = True
        elif inside and re.match(r"\s{3,}\S", line):
            entries[-1] += " " + line.strip()
        else:
            inside = False
    return entries


def test_each_commands_help_tells_the_two_words_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every command's --adaptor / --adapter entry says which of the two it is; the commands that take them are
    found (the check cannot pass by finding none)."""
    monkeypatch.setenv("COLUMNS", "400")  # argparse wraps at the terminal's width
    found: dict[str, set[str]] = {}
    for command in COMMANDS:
        for entry in _option_entries(_help(command)):
            for option, words in WORDS.items():
                if re.match(rf"{option}\b", entry):
                    found.setdefault(option, set()).add(command)
                    assert words in entry, f"`portspeed {command} --help`: {option} does not say {words!r}: {entry}"
    assert found == {"--adaptor": {"run", "patches"}, "--adapter": {"info", "conformance"}}, found


def test_the_command_list_names_which_of_the_two() -> None:
    """`portspeed --help`'s one line per command: a line that mentions either word says which one it means."""
    for command, (_, line) in COMMANDS.items():
        if "adaptor" in line:
            assert "framework set-up" in line, (command, line)
        if re.search(r"\badapters?\b", line):
            assert "device adapter" in line, (command, line)

