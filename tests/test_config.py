"""PORTSPEED_* parsing: valid spellings are read, garbage in any variable raises ConfigError naming it."""

from __future__ import annotations


import pytest

from portspeed import config
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
