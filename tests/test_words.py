"""The project's two words one letter apart, as a user meets them: the help says "framework set-up" for
``--adaptor`` (a framework's set-up module) and "device adapter" for ``--adapter``; and a refused adapter file is
named as the user wrote it (``path/zeta.py:Zeta``), never by the module name portspeed imports the file under."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from portspeed import cli
from portspeed.accelerator import get_accelerator, registry
from portspeed.cli.main import COMMANDS
from portspeed.errors import PortspeedError

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


def test_the_glossary_tells_the_two_words_apart() -> None:
    """docs/architecture.md's glossary has a row for each word, naming its own option."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| (adaptor|adapter)\b.*$", text, re.M)}
    assert set(rows) == {"adaptor", "adapter"}, rows
    assert "--adaptor" in rows["adaptor"] and "--adapter" not in rows["adaptor"], rows["adaptor"]
    assert "--adapter" in rows["adapter"] and "--adaptor" not in rows["adapter"], rows["adapter"]


# ------------------------------------------------------------------ an adapter file named as written
BROKEN = {
    "missing member": ("from portspeed.vendor import Accelerator\n\n"
                       "class Zeta(Accelerator):\n    name = 'zeta'\n    backend = 'gloo'\n",
                       "adapter class path/zeta.py:Zeta lacks the required member 'device_type'"),
    "bad declaration": ("from portspeed.vendor import Accelerator\n\n"
                        "class Base(Accelerator, abstract=True):\n    name = 'zeta'\n    backend = 'gloo'\n\n"
                        "class Zeta(Base):\n    device_type = 'cpu'\n    total_memory_bytes = -1\n",
                        "adapter class path/zeta.py:Zeta: total_memory_bytes = -1"),
    "not an adapter": ("class Zeta:\n    pass\n",
                       "it names path/zeta.py:Zeta, which is not a portspeed.vendor.Accelerator subclass"),
}


def _refusal(how: str, spec: str, capsys: pytest.CaptureFixture[str], portspeed_env) -> str:
    """The refusal of ``spec`` through ``portspeed info --adapter``, ``portspeed conformance --adapter`` or the
    selection (PORTSPEED_ACCELERATOR)."""
    if how == "selection":
        portspeed_env(PORTSPEED_ACCELERATOR=spec)
        with pytest.raises(PortspeedError) as exc:
            get_accelerator()
        return str(exc.value)
    assert cli.main([how, "--adapter", spec]) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("how", ["info", "conformance", "selection"])
@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_a_refused_adapter_file_is_named_as_the_user_wrote_it(kind: str, how: str, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str],
                                                              portspeed_env) -> None:
    """The class is named ``path/zeta.py:Zeta``; the internal module name (``portspeed_adapter_file_zeta_<digest>``)
    appears nowhere in the message."""
    source, expected = BROKEN[kind]
    (tmp_path / "path").mkdir()
    (tmp_path / "path" / "zeta.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    message = _refusal(how, "path/zeta.py:Zeta", capsys, portspeed_env)
    internal = registry.adapter_module_name("path/zeta.py")
    assert expected in message, message
    assert internal not in message and "portspeed_adapter_file" not in message, message
