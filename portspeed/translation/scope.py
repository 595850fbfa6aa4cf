"""Which modules are *framework modules*: the ones that see the translated torch.

Kept apart from ``portspeed.translation.importer`` (which imports torch and the views) because the
adaptors need the answer at their own import, before anything heavy is loaded: their
deferred activation (``portspeed.integrations.activation``) fires on the first import of a framework
module.

The prefixes are ``megatron``, the comma-separated names in ``PORTSPEED_FRAMEWORK_MODULES``
(validated: a typo raises ConfigError naming the variable), and those added with
``portspeed.translation.importer.add_framework_prefixes``. A module is a framework module when its
name equals a prefix or starts with a prefix and a dot; torch itself never is.
"""

from __future__ import annotations

import re

from portspeed import config

__all__ = ["FRAMEWORK_ENV", "DEFAULT_PREFIXES", "env_prefixes", "framework_prefixes", "is_framework_module",
           "is_under", "valid_prefix"]

#: Environment variable naming extra framework module prefixes (comma-separated; declared in portspeed.settings).
FRAMEWORK_ENV = config.BY_FIELD["framework_modules"].env
DEFAULT_PREFIXES: tuple[str, ...] = ("megatron",)
_PREFIX_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")

#: Prefixes added at run time (``translation.add_framework_prefixes``), in order.
extra_prefixes: list[str] = []


def valid_prefix(prefix: object) -> bool:
    """An importable dotted module name other than torch (or a torch submodule)."""
    return (isinstance(prefix, str) and bool(_PREFIX_RE.match(prefix))
            and prefix != "torch" and not prefix.startswith("torch."))


def env_prefixes() -> tuple[str, ...]:
    """The prefixes named in PORTSPEED_FRAMEWORK_MODULES, read afresh (tests and launchers change it); ConfigError
    names the bad ones."""
    return config.read("framework_modules")


def framework_prefixes() -> tuple[str, ...]:
    """Module-name prefixes that see the translated torch (defaults, env var, run-time additions)."""
    return tuple(dict.fromkeys(DEFAULT_PREFIXES + env_prefixes() + tuple(extra_prefixes)))


def is_under(name: str, prefixes: tuple[str, ...]) -> bool:
    """Whether module ``name`` equals one of ``prefixes`` or lies under one (``a.b`` is under ``a``)."""
    for p in prefixes:
        if name == p or name.startswith(p + "."):
            return True
    return False


def is_framework_module(name: str | None) -> bool:
    """Whether module ``name`` is a framework module; reads the prefixes afresh."""
    return bool(name) and is_under(name, framework_prefixes())
