"""PORTSPEED_* parsing: valid spellings are read, garbage in any variable raises ConfigError naming it."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from portspeed import config
from portspeed import settings as settings_mod
from portspeed.config import Settings, parse_bool
from portspeed.errors import ConfigError


pytestmark = pytest.mark.usefixtures("portspeed_env")  # tests/conftest.py


def test_defaults_when_nothing_is_set() -> None:
    s = Settings.from_env({})
    assert s == Settings()
    assert (s.accelerator, s.backend, s.strict, s.disable, s.log_level, s.timeout, s.loss_log) == (
        None, None, False, (), "WARNING", 300.0, None)


@pytest.mark.parametrize("value,expected", [
    ("1", True), ("true", True), ("Yes", True), (" ON ", True),
    ("0", False), ("false", False), ("NO", False), ("off", False), ("", False),
])
def test_strict_spellings(value: str, expected: bool) -> None:
    assert Settings.from_env({"PORTSPEED_STRICT": value}).strict is expected
    assert parse_bool("X", value) is expected


def test_names_are_normalised() -> None:
    s = Settings.from_env({"PORTSPEED_ACCELERATOR": " CPU ", "PORTSPEED_BACKEND": "Gloo",
                           "PORTSPEED_LOG_LEVEL": "debug", "PORTSPEED_TIMEOUT": " 12.5 ",
                           "PORTSPEED_LOSS_LOG": " /tmp/loss.json "})
    assert (s.accelerator, s.backend, s.log_level, s.timeout, s.loss_log) == (
        "cpu", "gloo", "DEBUG", 12.5, "/tmp/loss.json")


def test_disable_list_and_prefixes() -> None:
    s = Settings.from_env({"PORTSPEED_DISABLE": " megatron.fused_*, torch.cuda_to ,,"})
    assert s.disable == ("megatron.fused_*", "torch.cuda_to")
    assert s.is_disabled("torch.cuda_to")
    assert not s.is_disabled("torch.cuda_to_device")  # an exact name is not a prefix
    assert s.is_disabled("megatron.fused_adam") and s.is_disabled("megatron.fused_")
    assert not s.is_disabled("megatron.fuse")


def test_disable_star_alone_blocks_everything() -> None:
    assert Settings.from_env({"PORTSPEED_DISABLE": "*"}).is_disabled("anything.at_all")


@pytest.mark.parametrize("var,value,hint", [
    ("PORTSPEED_STRICT", "maybe", "1/0, true/false"),
    ("PORTSPEED_STRICT", "2", "1/0, true/false"),
    ("PORTSPEED_ACCELERATOR", "cuda:0", "adapter name"),
    ("PORTSPEED_ACCELERATOR", "9npu", "adapter name"),
    ("PORTSPEED_BACKEND", "nccl,gloo", "backend name"),
    ("PORTSPEED_BACKEND", "cpu:gloo", "backend name"),
    ("PORTSPEED_DISABLE", "good.name, bad name", "invalid patch names"),
    ("PORTSPEED_DISABLE", "a;b", "invalid patch names"),
    ("PORTSPEED_LOG_LEVEL", "LOUD", "DEBUG, INFO"),
    ("PORTSPEED_LOG_LEVEL", "10", "DEBUG, INFO"),
    ("PORTSPEED_TIMEOUT", "soon", "positive number of seconds"),
    ("PORTSPEED_TIMEOUT", "-5", "positive number of seconds"),
    ("PORTSPEED_TIMEOUT", "0", "positive number of seconds"),
    ("PORTSPEED_TIMEOUT", "nan", "positive number of seconds"),
    ("PORTSPEED_TIMEOUT", "inf", "positive number of seconds"),
    ("PORTSPEED_TIMEOUT", "٣", "positive number of seconds"),
    ("PORTSPEED_HANG_TIMEOUT", "0", "positive number of seconds"),
    ("PORTSPEED_HANG_TIMEOUT", "later", "positive number of seconds"),
    ("PORTSPEED_TRACE", "²", "ASCII digits"),
    ("PORTSPEED_TRACE", "-3", "non-negative integer"),
])
def test_garbage_raises_naming_the_variable(var: str, value: str, hint: str) -> None:
    with pytest.raises(ConfigError) as exc:
        Settings.from_env({var: value})
    msg = str(exc.value)
    assert var in msg and hint in msg


def test_settings_are_cached_until_reload(monkeypatch: pytest.MonkeyPatch) -> None:
    """settings() reads the environment once; reload() re-reads it (and fails loudly on garbage)."""
    monkeypatch.setenv("PORTSPEED_STRICT", "1")
    assert config.reload().strict is True
    monkeypatch.setenv("PORTSPEED_STRICT", "0")
    assert config.settings().strict is True  # cached
    assert config.reload().strict is False
    monkeypatch.setenv("PORTSPEED_TIMEOUT", "never")
    with pytest.raises(ConfigError, match="PORTSPEED_TIMEOUT"):
        config.reload()


@pytest.mark.parametrize("env,trace,hang", [
    ({}, 0, None),
    ({"PORTSPEED_TRACE": "00"}, 0, None),
    ({"PORTSPEED_TRACE": "+5"}, 5, None),
    ({"PORTSPEED_TRACE": " 7 "}, 7, None),
    ({"PORTSPEED_HANG_TIMEOUT": "10"}, config.HANG_TRACE_ENTRIES, 10.0),
    ({"PORTSPEED_HANG_TIMEOUT": " 2.5 ", "PORTSPEED_TRACE": "64"}, 64, 2.5),
    ({"PORTSPEED_HANG_TIMEOUT": "10", "PORTSPEED_TRACE": "0"}, 0, 10.0),  # `portspeed run` refuses this pair
])
def test_trace_and_hang_timeout_have_one_reading(env: dict, trace: int, hang: float | None) -> None:
    """The recorder's entries and the hang timeout, as the launcher and every rank read them (one parser)."""
    s = Settings.from_env(env)
    assert (s.trace, s.hang_timeout) == (trace, hang)


# ------------------------------------------------------------------ one declaration per setting
ROOT = Path(__file__).resolve().parents[1]
#: the modules that read user settings from os.environ: the declarations and their one reader
DECLARATION_MODULES = {ROOT / "portspeed" / "settings.py", ROOT / "portspeed" / "config.py"}
#: PORTSPEED_* variables portspeed sets for processes it starts, read where they are handed over (not user settings)
INTERNAL_PREFIXES = ("PORTSPEED_RUN_", "PORTSPEED_TESTDEV_")
#: other internal variables read outside the declarations, each with its reason
INTERNAL_EXCEPTIONS = {
    "PORTSPEED_RANK_REPORT_DIR": "set by `portspeed megatron-tests` for the pytest processes it starts and read by "
                                 "their plugin (portspeed.testing.pytest_rank_report): a hand-off like PORTSPEED_RUN_*",
}


def test_settings_fields_preflight_names_and_switches_come_from_the_declarations() -> None:
    """``Settings``, the preflight's list of names and `portspeed run`'s probe switches follow ``TABLE``."""
    import dataclasses

    from portspeed.accelerator import preflight
    from portspeed.cli.run import build_parser

    assert [f.name for f in dataclasses.fields(Settings)] == [s.field for s in settings_mod.TABLE]
    assert Settings() == Settings(**{s.field: s.default for s in settings_mod.TABLE})
    assert preflight.SETTINGS == tuple(s.env for s in settings_mod.TABLE)
    assert len(set(preflight.SETTINGS)) == len(preflight.SETTINGS) and all(
        n.startswith("PORTSPEED_") for n in preflight.SETTINGS)
    options = {o for a in build_parser()._actions for o in a.option_strings}
    run_switches = {s.switch for s in settings_mod.TABLE if s.switch and s.command == "portspeed run"}
    assert run_switches and run_switches <= options, run_switches - options


def test_usage_table_is_the_generated_one() -> None:
    """docs/usage.md's table is ``python -m portspeed.settings --markdown``'s output (regenerate it when this fails)."""
    text = (ROOT / "docs" / "usage.md").read_text()
    start = text.index("\n", text.index("<!-- the table below is generated")) + 1
    end = text.index("<!-- end of the generated table -->")
    assert text[start:end] == settings_mod.markdown(), "run: python -m portspeed.settings --markdown"
    out = subprocess.run([sys.executable, "-m", "portspeed.settings", "--markdown"], capture_output=True, text=True,
                         check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout == settings_mod.markdown()


@pytest.mark.parametrize("switch,value,expected", [
    ("--probe-ranks", "+5, 3", "3,5"), ("--probe-iterations", "+2:+4", "2:4"), ("--probe-level", " OP ", "op")])
def test_probe_switch_and_variable_have_one_reading(switch: str, value: str, expected: str, tmp_path: Path) -> None:
    """`portspeed run`'s switch and the workers' variable go through one parser: what one accepts the other does."""
    from portspeed.cli import run
    from portspeed.probe.cli import options as probe_options

    args = run.build_parser().parse_args(["--probe", str(tmp_path / "dump"), switch, value, "train.py"])
    env = probe_options.environment(args, world=8)
    var = next(s.env for s in settings_mod.TABLE if s.switch == switch)
    assert env[var] == expected
    field = settings_mod.BY_ENV[var].field
    assert getattr(Settings.from_env({"PORTSPEED_PROBE_DIR": str(tmp_path), var: value}), field) == \
        getattr(Settings.from_env({"PORTSPEED_PROBE_DIR": str(tmp_path), var: env[var]}), field)


def test_every_folder_setting_has_one_writable_check(tmp_path: Path) -> None:
    """PORTSPEED_TRACE_DIR, PORTSPEED_PROBE_DIR and --probe refuse an unwritable folder with one check's words."""
    bad = str(tmp_path / "file" / "dump")
    (tmp_path / "file").write_text("")
    for var in ("PORTSPEED_TRACE_DIR", "PORTSPEED_PROBE_DIR"):
        with pytest.raises(ConfigError, match=f"{var}={bad!r} is not a writable folder .* is not a folder"):
            Settings.from_env({var: bad})
    with pytest.raises(ConfigError, match=f"--probe {bad!r} is not a writable folder"):
        settings_mod.BY_FIELD["probe_dir"].parse("--probe", bad)
    assert Settings.from_env({"PORTSPEED_TRACE_DIR": str(tmp_path / "new")}).trace_dir == str(tmp_path / "new")


def _environ(node: ast.AST, aliases: set[str]) -> bool:
    """Whether ``node`` is os.environ (or ``environ``, or a local name bound to it)."""
    if isinstance(node, ast.Attribute):
        return node.attr == "environ" and isinstance(node.value, ast.Name) and node.value.id == "os"
    return isinstance(node, ast.Name) and (node.id == "environ" or node.id in aliases)


def _env_reads(tree: ast.AST, names: dict[str, str]) -> list[tuple[int, str]]:
    """(line, variable) of every read of a PORTSPEED_* variable from os.environ / os.getenv in ``tree``."""
    def value(node: ast.AST) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value if node.value.startswith("PORTSPEED_") else None
        if isinstance(node, (ast.Name, ast.Attribute)):
            ident = node.id if isinstance(node, ast.Name) else node.attr
            if isinstance(node, ast.Attribute) and ident == "env" and isinstance(node.value, ast.Subscript):
                key = node.value.slice
                if isinstance(key, ast.Constant) and key.value in settings_mod.BY_FIELD:
                    return settings_mod.BY_FIELD[key.value].env
            return names.get(ident)
        return None

    aliases = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets
               if isinstance(t, ast.Name) and (_environ(n.value, set()) or isinstance(n.value, ast.IfExp) and (
                   _environ(n.value.body, set()) or _environ(n.value.orelse, set())))}
    found = []
    for n in ast.walk(tree):
        key = None
        if isinstance(n, ast.Call) and n.args:
            f = n.func
            if isinstance(f, ast.Attribute) and f.attr in ("get", "pop", "setdefault") and _environ(f.value, aliases):
                key = n.args[0]
            elif (f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)) == "getenv":
                key = n.args[0]
        elif isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Load) and _environ(n.value, aliases):
            key = n.slice
        elif isinstance(n, ast.Compare) and len(n.ops) == 1 and isinstance(n.ops[0], (ast.In, ast.NotIn)) \
                and _environ(n.comparators[0], aliases):
            key = n.left
        var = value(key) if key is not None else None
        if var is not None:
            found.append((n.lineno, var))
    return found


def test_user_settings_are_read_from_the_environment_only_where_declared() -> None:
    """A PORTSPEED_* user setting read from os.environ outside portspeed.settings / portspeed.config would be a
    second reading (its own parsing, its own rules): read ``config.settings()`` (or ``config.read``) instead."""
    files = [p for d in ("portspeed", "patches", "adapters") for p in sorted((ROOT / d).rglob("*.py"))]
    trees = {p: ast.parse(p.read_text(), str(p)) for p in files}
    names = {t.id: n.value.value for tree in trees.values() for n in ast.walk(tree) if isinstance(n, ast.Assign)
             and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
             and n.value.value.startswith("PORTSPEED_") for t in n.targets if isinstance(t, ast.Name)}
    names.update({k: v for k, v in vars(config).items() if isinstance(v, str) and v.startswith("PORTSPEED_")})
    bad = [f"{p.relative_to(ROOT)}:{line}: {var}" for p, tree in trees.items() if p not in DECLARATION_MODULES
           for line, var in _env_reads(tree, names)
           if not var.startswith(INTERNAL_PREFIXES) and var not in INTERNAL_EXCEPTIONS]
    assert not bad, bad
    planted = ast.parse('import os\nX = "PORTSPEED_STRICT"\nos.environ.get(X)\nos.getenv("PORTSPEED_TRACE")\n'
                        'e = os.environ\ne[config.BY_FIELD["backend"].env]\n"PORTSPEED_NAN_CHECK" in os.environ\n')
    assert [v for _, v in _env_reads(planted, {"X": "PORTSPEED_STRICT"})] == [
        "PORTSPEED_STRICT", "PORTSPEED_TRACE", "PORTSPEED_BACKEND", "PORTSPEED_NAN_CHECK"]
