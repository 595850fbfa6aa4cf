"""One gate: whether a declared patch applies here, before its target is imported.

The patch manager and `portspeed info` call the same ``gate()``, so what `info` predicts is
what the manager does, in the same words. The checks, in order:

1. ``PORTSPEED_DISABLE`` names the patch                        -> ``disabled``
2. its distribution is not installed                            -> ``skipped``
3. the installed (or imported) release is outside its range     -> ``inactive``
   (a range narrowed because it was *not run* on that release, though the release is inside
   ``versions.SUPPORTED``, is also noted in the cache; ``check_versions`` says it once)
4. its condition on the adapter (``when=``) raises              -> ``failed``
5. its condition is false                                       -> ``inactive``
6. otherwise                                                    -> ``pending`` (applies once its module is imported)

The adapter is handed in by the caller (a function returning it, called only when a patch
has a condition), so this engine module never selects one itself.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

from portspeed import config
from portspeed.errors import PatchStrictError
from portspeed.patching.narrowing import NOT_RUN
from portspeed.versions import SUPPORTED, GateVersion, gate_version

if TYPE_CHECKING:
    from portspeed.config import Settings
    from portspeed.patching.record import Patch

log = logging.getLogger("portspeed.patches")

__all__ = ["GATE_STATUSES", "VersionCache", "check_versions", "gate"]

#: The statuses ``gate`` answers with (a subset of the manager's ``STATUSES``).
GATE_STATUSES = ("disabled", "skipped", "inactive", "failed", "pending")


class VersionCache(dict):
    """distribution -> GateVersion, looked up once per gating pass (read from ``package_info.py``: nothing imported).

    ``untested`` collects (patch, release, range) for each patch left out of a supported release
    only because its range was not run there (``narrowing.NOT_RUN``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.untested: list[tuple[str, str, Any]] = []  # (patch, "distribution release", range)

    def __missing__(self, distribution: str) -> GateVersion:
        gv = self[distribution] = gate_version(distribution)
        return gv


def gate(patch: Patch, settings: Settings, accelerator: Callable[[], Any],
         versions: VersionCache | None = None) -> tuple[str, str]:
    """(status, why) for ``patch``: see the module docstring for the order of the checks."""
    if settings.is_disabled(patch.name):
        return "disabled", "blocked by PORTSPEED_DISABLE"
    if patch.distribution:
        gv = (versions if versions is not None else VersionCache())[patch.distribution]
        if gv.version is None:
            return "skipped", f"distribution {patch.distribution!r} is not installed (needed by target {patch.target})"
        if patch.versions and gv.version not in patch.specifier:
            # a declared range is a decision (this patch is for other releases), not drift
            why = (f"{gv.describe(patch.distribution)} is outside the range {str(patch.versions)!r} "
                   f"this patch is written for")
            if getattr(patch.versions, "kind", None) == NOT_RUN and _supported(patch.distribution, gv.version):
                if versions is not None:
                    versions.untested.append((patch.name, f"{patch.distribution} {gv.version}", patch.versions))
                why += f", which was narrowed because it was {patch.versions.describe()}"
            return "inactive", why
    if patch.when is not None:
        acc = accelerator()
        if acc is None:
            return "failed", "has a condition on the adapter, and no adapter could be selected"
        try:
            ok = bool(patch.when(acc))
        except Exception as exc:  # a broken condition is a failed patch, not a silent skip
            return "failed", f"condition raised {type(exc).__name__}: {exc}"
        if not ok:
            return "inactive", f"condition false for accelerator {acc.name!r}"
    return "pending", f"waiting for `import {patch.module}`"


def _supported(distribution: str, version: Any) -> bool:
    from packaging.specifiers import SpecifierSet

    spec = SUPPORTED.get(distribution)
    return spec is not None and version in SpecifierSet(spec, prereleases=True)


def check_versions(seen: dict[str, GateVersion], said: set[str]) -> None:
    """Say once when imported code shadows the installed release, and when a release is untested.

    A version outside ``versions.SUPPORTED`` is one no patch was checked against: the patches
    whose ranges admit it still apply (most releases keep most targets), with one warning
    naming the supported range; under PORTSPEED_STRICT=1 it is an error. A supported release that
    a patch's "not run there" range leaves out (``VersionCache.untested``) gets one line per patch.
    """
    for name, release, spec in getattr(seen, "untested", ()):
        key = f"untested:{name}=={release}"
        if key not in said:
            said.add(key)
            log.warning("portspeed: patch %s is not applied to %s, which is inside the supported range, because "
                        "its range %r was not run there (%s); what it fixes may fail on %s. Run it there and "
                        "widen its range.", name, release, str(spec), spec.evidence, release)
    from packaging.specifiers import SpecifierSet

    for dist, gv in seen.items():
        if gv.version is None:
            continue
        key = f"{dist}=={gv.version}@{gv.source}"
        if gv.shadowed and key + ":shadow" not in said:
            said.add(key + ":shadow")
            log.warning("portspeed: %s", gv.describe(dist))
        supported = SUPPORTED.get(dist)
        if supported is None or gv.version in SpecifierSet(supported, prereleases=True):
            continue
        message = (f"{gv.describe(dist)} is outside the range portspeed's patches were checked against "
                   f"({dist} {supported})")
        if config.settings().strict:
            raise PatchStrictError(
                f"PORTSPEED_STRICT=1 and {message}. Install a {dist} in {supported!r}, or unset "
                f"PORTSPEED_STRICT to run with the patches whose ranges admit it "
                f"(`portspeed patches --check {gv.version}` lists the targets that changed).")
        if key not in said:
            said.add(key)
            log.warning("portspeed: %s; the patches whose ranges admit it are applied untested. "
                        "`portspeed patches --check %s` lists targets that moved or changed; "
                        "PORTSPEED_STRICT=1 makes this an error.", message, gv.version)
