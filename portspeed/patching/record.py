"""The Patch record: one frozen description of one change to one framework object.

A patch names its target as ``"package.module:Qualified.attr"`` (the module part is
what gets imported; the part after the colon is walked with getattr), says whether it
**replaces** the target or **wraps** it, carries the replacement or the wrapper, the
distribution and PEP 440 version range it is written for, an optional condition on the
active accelerator, one sentence of why, and the fingerprints of its target's source in the
releases it was checked against (``portspeed.patching.drift``: drift shows before users meet it).

Wrappers use wrapt's signature ``wrapper(wrapped, instance, args, kwargs)`` and are
installed as ``wrapt.FunctionWrapper`` objects (``style="wrapt"``, the default). For a
module-level function on a per-call hot path, ``style="function"`` takes a factory
instead: ``impl(inner)`` returns a plain function that calls ``inner`` (decorate it with
``functools.wraps(inner)`` so name, docstring and signature stay right). It skips the
wrapt object and its ``(wrapped, instance, args, kwargs)`` call on every call: measurably
cheaper for collectives (docs/benchmarks.md). Several wrappers of one target, of either style, chain
by ``order`` (lower is closer to the original), then by registration order.

A module that cannot be imported at all off CUDA (it imports triton at its top, or a
compiled helper a checkout lacks) cannot be patched by attribute. ``kind="finder"`` declares
an import finder instead: ``target="sys:meta_path"``, ``impl`` the finder object
(``find_spec``), ``placement`` "first" (it answers before the normal finders) or "last" (only
what nothing else found). The manager puts it on ``sys.meta_path`` when the patch applies,
reports it, and takes it off on ``revert()``, like any other patch.

Example::

    Patch(
        name="megatron.parallel_state.backend",
        target="megatron.core.parallel_state:initialize_model_parallel",
        kind="wrap",
        impl=route_backend,
        distribution="megatron-core",
        versions=">=0.14,<0.17",
        reason="Megatron creates its sub-groups with NCCL; route them to the adapter's backend.",
    )
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Any, Callable, Literal

from portspeed.errors import PatchDefinitionError

if TYPE_CHECKING:  # pragma: no cover
    from packaging.specifiers import SpecifierSet

    from portspeed.accelerator import Accelerator

__all__ = ["FINDER", "FINDER_TARGET", "Patch", "PatchKind", "REPLACE", "WRAP", "WrapStyle"]

PatchKind = Literal["replace", "wrap", "finder"]
REPLACE: PatchKind = "replace"
WRAP: PatchKind = "wrap"
FINDER: PatchKind = "finder"
#: the one target a finder patch changes
FINDER_TARGET = "sys:meta_path"
WrapStyle = Literal["wrapt", "function"]

_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


@dataclasses.dataclass(frozen=True)
class Patch:
    """One declared change. See the module docstring for the contract."""

    name: str
    target: str
    kind: PatchKind
    impl: Any
    reason: str
    distribution: str | None = None
    versions: str = ""
    when: "Callable[[Accelerator], bool] | None" = None
    order: int = 0
    style: WrapStyle = "wrapt"
    #: release -> fingerprint of the target's source in that release (portspeed.patching.drift); a dict is accepted
    fingerprints: tuple[tuple[str, str], ...] = ()
    #: finder patches only: "first" or "last" on sys.meta_path
    placement: Literal["first", "last"] = "first"

    def __post_init__(self) -> None:
        if isinstance(self.fingerprints, dict):
            object.__setattr__(self, "fingerprints", tuple(sorted(self.fingerprints.items())))
        if not isinstance(self.name, str) or not re.match(r"^[A-Za-z0-9_.\-]+$", self.name):
            raise PatchDefinitionError(f"patch name {self.name!r} must be non-empty letters, digits, '.', '_', '-'")
        if not isinstance(self.target, str):
            raise PatchDefinitionError(
                f"patch {self.name!r}: target must be a string 'package.module:Attr.path', "
                f"not {type(self.target).__name__}"
            )
        module, sep, attr = self.target.partition(":")
        if not sep or not _MODULE.match(module) or not _MODULE.match(attr):
            raise PatchDefinitionError(
                f"patch {self.name!r}: target {self.target!r} must be 'package.module:Attr.path' "
                "(module, a colon, then the attribute path inside it)"
            )
        if self.kind not in (REPLACE, WRAP, FINDER):
            raise PatchDefinitionError(
                f"patch {self.name!r}: kind must be 'replace', 'wrap' or 'finder', not {self.kind!r}")
        if self.kind == FINDER:
            if self.target != FINDER_TARGET or not callable(getattr(self.impl, "find_spec", None)):
                raise PatchDefinitionError(
                    f"patch {self.name!r}: a finder patch has target {FINDER_TARGET!r} and an impl with "
                    f"find_spec() (an importlib.abc.MetaPathFinder), got {self.target!r} and "
                    f"{type(self.impl).__name__}")
            if self.placement not in ("first", "last"):
                raise PatchDefinitionError(f"patch {self.name!r}: placement must be 'first' or 'last', "
                                           f"not {self.placement!r}")
        if not callable(self.impl) and self.kind == WRAP:
            raise PatchDefinitionError(
                f"patch {self.name!r}: a wrap patch needs a callable wrapper(wrapped, instance, args, kwargs), "
                f"got {type(self.impl).__name__}"
            )
        if self.style not in ("wrapt", "function"):
            raise PatchDefinitionError(f"patch {self.name!r}: style must be 'wrapt' or 'function', not {self.style!r}")
        if self.style == "function" and self.kind != WRAP:
            raise PatchDefinitionError(
                f"patch {self.name!r}: style='function' is for wrap patches (a factory impl(inner) -> callable); "
                "a replacement is already a plain function"
            )
        if not isinstance(self.reason, str) or not self.reason.strip():
            raise PatchDefinitionError(f"patch {self.name!r}: give one sentence of why it is needed (reason=...)")
        if self.when is not None and not callable(self.when):
            raise PatchDefinitionError(
                f"patch {self.name!r}: when must be a callable taking the accelerator, not {type(self.when).__name__}"
            )
        if isinstance(self.order, bool) or not isinstance(self.order, int):
            raise PatchDefinitionError(f"patch {self.name!r}: order must be an int, not {self.order!r}")
        if self.distribution is not None and (not isinstance(self.distribution, str) or not self.distribution.strip()):
            raise PatchDefinitionError(
                f"patch {self.name!r}: distribution must be a distribution name such as 'megatron-core', "
                f"not {self.distribution!r}"
            )
        if not isinstance(self.versions, str):
            raise PatchDefinitionError(
                f"patch {self.name!r}: versions must be a PEP 440 specifier string such as '>=0.14,<0.17', "
                f"not {self.versions!r}"
            )
        if self.versions:
            if not self.distribution:
                raise PatchDefinitionError(f"patch {self.name!r}: a version range needs a distribution name")
            from packaging.specifiers import InvalidSpecifier, SpecifierSet  # when a patch is declared, not at import

            try:
                SpecifierSet(self.versions)
            except InvalidSpecifier as exc:
                raise PatchDefinitionError(
                    f"patch {self.name!r}: versions {self.versions!r} is not a PEP 440 specifier ({exc})"
                ) from None

    @property
    def module(self) -> str:
        """The module to import (left of the colon)."""
        return self.target.partition(":")[0]

    @property
    def attr_path(self) -> tuple[str, ...]:
        """The attribute path inside the module (right of the colon), split on dots."""
        return tuple(self.target.partition(":")[2].split("."))

    @property
    def specifier(self) -> SpecifierSet:
        """The version range as a SpecifierSet (pre-releases admitted: dev builds of Megatron are common)."""
        from packaging.specifiers import SpecifierSet

        return SpecifierSet(self.versions, prereleases=True)
