"""Environment settings (PORTSPEED_*), read once and validated, so a typo fails loudly.

Every variable is optional. Values are read when first needed, not at import of
portspeed, and `reload()` re-reads them (tests change the environment).

| variable | values | meaning |
|---|---|---|
| PORTSPEED_ACCELERATOR | adapter name (`cpu`, `cuda`, `npu`, ...) | skip auto-detection |
| PORTSPEED_BACKEND | c10d backend name (`gloo`, `nccl`, `hccl`, ...) | override the adapter's default backend |
| PORTSPEED_STRICT | 0/1, true/false, yes/no, on/off | any skipped or failed patch raises |
| PORTSPEED_DISABLE | comma-separated patch names or name prefixes | block those patches |
| PORTSPEED_LOG_LEVEL | DEBUG, INFO, WARNING, ERROR | portspeed's logger level |
| PORTSPEED_TIMEOUT | seconds (positive number) | collective / rendezvous timeout used by launchers and tests |
| PORTSPEED_GLOO_LAZY_INIT | 0/1 (default 1) | Gloo groups connect their ranks at their first collective, not when created (torch >= 2.8; an explicit TORCH_GLOO_LAZY_INIT wins; see ``portspeed.comm.gloo_init``) |
| PORTSPEED_LOSS_LOG | file path | where a training script writes its JSON loss record (`portspeed.megatron_adaptor.open_loss_log`, used by examples/pretrain_gpt.py; the stock scripts print losses instead, which `portspeed compare` parses) |
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Mapping

from portspeed.errors import ConfigError

__all__ = ["Settings", "settings", "reload", "parse_bool", "parse_names"]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
_NAME = re.compile(r"^[a-z][a-z0-9_\-]*$")
_PATCH_NAME = re.compile(r"^[A-Za-z0-9_.\-*]+$")
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def parse_bool(var: str, value: str) -> bool:
    """Parse a boolean environment value or raise naming the variable and the accepted spellings."""
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ConfigError(
        f"{var}={value!r} is not a boolean; use one of 1/0, true/false, yes/no, on/off"
    )


def parse_names(var: str, value: str, pattern: re.Pattern[str], kind: str, hint: str) -> tuple[str, ...]:
    """Split a comma-separated list of names, or raise naming the variable, the bad names and ``hint``."""
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    bad = [n for n in names if not pattern.match(n)]
    if bad:
        raise ConfigError(f"{var} has invalid {kind} {bad}; {hint}")
    return names


@dataclasses.dataclass(frozen=True)
class Settings:
    """The validated PORTSPEED_* environment."""

    accelerator: str | None = None
    backend: str | None = None
    strict: bool = False
    disable: tuple[str, ...] = ()
    log_level: str = "WARNING"
    timeout: float = 300.0
    loss_log: str | None = None
    gloo_lazy_init: bool = True

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Settings":
        env = os.environ if env is None else env
        kw: dict = {}
        acc = env.get("PORTSPEED_ACCELERATOR", "").strip()
        if acc:
            if not _NAME.match(acc.lower()):
                raise ConfigError(
                    f"PORTSPEED_ACCELERATOR={acc!r} is not an adapter name; expected something like "
                    "'cpu', 'cuda', 'npu' (run `portspeed info` to list the adapters)"
                )
            kw["accelerator"] = acc.lower()
        backend = env.get("PORTSPEED_BACKEND", "").strip()
        if backend:
            if not _NAME.match(backend.lower()):
                raise ConfigError(
                    f"PORTSPEED_BACKEND={backend!r} is not a backend name; expected one name such as "
                    "'gloo', 'nccl', 'hccl', 'xccl' (no device prefixes, no commas)"
                )
            kw["backend"] = backend.lower()
        if "PORTSPEED_STRICT" in env:
            kw["strict"] = parse_bool("PORTSPEED_STRICT", env["PORTSPEED_STRICT"])
        disable = env.get("PORTSPEED_DISABLE", "").strip()
        if disable:
            kw["disable"] = parse_names(
                "PORTSPEED_DISABLE", disable, _PATCH_NAME, "patch names",
                "give comma-separated names as listed by `portspeed patches` (a trailing '*' matches a prefix)")
        level = env.get("PORTSPEED_LOG_LEVEL", "").strip()
        if level:
            if level.upper() not in _LEVELS:
                raise ConfigError(
                    f"PORTSPEED_LOG_LEVEL={level!r} is not a logging level; use one of {', '.join(_LEVELS)}"
                )
            kw["log_level"] = level.upper()
        timeout = env.get("PORTSPEED_TIMEOUT", "").strip()
        if timeout:
            try:
                t = float(timeout)
            except ValueError:
                t = -1.0
            if not (t > 0 and t < 1e7):
                raise ConfigError(
                    f"PORTSPEED_TIMEOUT={timeout!r} is not a positive number of seconds"
                )
            kw["timeout"] = t
        if "PORTSPEED_GLOO_LAZY_INIT" in env:
            kw["gloo_lazy_init"] = parse_bool("PORTSPEED_GLOO_LAZY_INIT", env["PORTSPEED_GLOO_LAZY_INIT"])
        loss_log = env.get("PORTSPEED_LOSS_LOG", "").strip()
        if loss_log:
            kw["loss_log"] = loss_log
        return cls(**kw)

    def is_disabled(self, patch_name: str) -> bool:
        """True when PORTSPEED_DISABLE names this patch or a prefix ending in '*'."""
        for n in self.disable:
            if n.endswith("*"):
                if patch_name.startswith(n[:-1]):
                    return True
            elif n == patch_name:
                return True
        return False


_settings: Settings | None = None


def settings() -> Settings:
    """The current settings, read from the environment on first use."""
    global _settings
    if _settings is None:
        _settings = Settings.from_env()
    return _settings


def reload() -> Settings:
    """Re-read the environment (for tests and launchers that change it)."""
    global _settings
    _settings = None
    return settings()
