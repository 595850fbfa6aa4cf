"""The Patch record: malformed declarations fail at definition time with a message that says what to fix."""

from __future__ import annotations

from typing import Any

import pytest
from packaging.version import Version

from portspeed.errors import PatchDefinitionError
from portspeed.patching.record import REPLACE, WRAP, Patch


def wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    return wrapped(*args, **kwargs)


def make(**kw: Any) -> Patch:
    fields: dict[str, Any] = dict(name="p.one", target="pkg.mod:Cls.attr", kind=WRAP, impl=wrapper,
                                  reason="needed because of a test")
    fields.update(kw)
    return Patch(**fields)


def test_valid_patch_parts() -> None:
    """A valid record splits its target into module and attribute path and parses its range."""
    p = make(distribution="megatron-core", versions=">=0.14,<0.17")
    assert p.module == "pkg.mod"
    assert p.attr_path == ("Cls", "attr")
    assert Version("0.16.1") in p.specifier and Version("0.17.0") not in p.specifier
    assert Version("0.16.0rc1") in p.specifier  # pre-releases are admitted on purpose
    assert make(kind=REPLACE, impl=42).impl == 42  # a replacement may be any object (a constant, a class)


def test_patch_is_frozen_and_comparable() -> None:
    p = make()
    with pytest.raises(AttributeError):
        p.name = "other"  # type: ignore[misc]
    assert p == make() and p != make(order=1)


@pytest.mark.parametrize("target", [
    "pkg.mod",            # no colon
    "pkg.mod:",           # no attribute
    ":attr",              # no module
    "1pkg.mod:f",         # module part not an identifier
    "pkg..mod:f",         # empty module segment
    "pkg.mod:f.",         # trailing dot in the attribute path
    "pkg.mod::f",         # two colons
    "pkg.mod:f-g",        # attribute not an identifier
    "pkg mod:f",          # space
])
def test_malformed_target(target: str) -> None:
    with pytest.raises(PatchDefinitionError, match="'package.module:Attr.path'") as exc:
        make(target=target)
    assert repr(target) in str(exc.value)


def test_target_not_a_string() -> None:
    with pytest.raises(PatchDefinitionError, match="target must be a string"):
        make(target=("pkg.mod", "f"))


@pytest.mark.parametrize("name", ["", "has space", "slash/name", None])
def test_bad_name(name: Any) -> None:
    with pytest.raises(PatchDefinitionError, match="must be non-empty letters"):
        make(name=name)


@pytest.mark.parametrize("kind", ["wrapper", "REPLACE", "", None])
def test_bad_kind(kind: Any) -> None:
    with pytest.raises(PatchDefinitionError, match="kind must be 'replace', 'wrap' or 'finder'"):
        make(kind=kind)


@pytest.mark.parametrize("reason", ["", "   ", None])
def test_empty_reason(reason: Any) -> None:
    with pytest.raises(PatchDefinitionError, match="why it is needed"):
        make(reason=reason)


@pytest.mark.parametrize("versions", [">=0.14,<", "0.14..1", "~=1", "latest", "=>1.0"])
def test_invalid_version_specifier(versions: str) -> None:
    with pytest.raises(PatchDefinitionError, match="not a PEP 440 specifier") as exc:
        make(distribution="megatron-core", versions=versions)
    assert repr(versions) in str(exc.value)


def test_versions_need_a_distribution() -> None:
    with pytest.raises(PatchDefinitionError, match="needs a distribution name"):
        make(versions=">=1")


@pytest.mark.parametrize("distribution", ["", "  ", 3])
def test_bad_distribution(distribution: Any) -> None:
    with pytest.raises(PatchDefinitionError, match="distribution must be a distribution name"):
        make(distribution=distribution)


@pytest.mark.parametrize("impl", [None, 42, "module:func"])
def test_wrap_needs_a_callable(impl: Any) -> None:
    with pytest.raises(PatchDefinitionError, match="callable wrapper") as exc:
        make(impl=impl)
    assert type(impl).__name__ in str(exc.value)


def test_when_must_be_callable() -> None:
    with pytest.raises(PatchDefinitionError, match="when must be a callable"):
        make(when="cuda")


@pytest.mark.parametrize("order", ["1", 1.5, True])
def test_order_must_be_int(order: Any) -> None:
    with pytest.raises(PatchDefinitionError, match="order must be an int"):
        make(order=order)


def test_versions_must_be_a_string() -> None:
    with pytest.raises(PatchDefinitionError, match="PEP 440 specifier string"):
        make(distribution="megatron-core", versions=None)
