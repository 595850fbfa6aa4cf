"""Installing patched targets and putting originals back, each batch followed by one rebinding sweep.

Why a module of its own: this is the part of the manager that touches framework objects.
The manager decides *what* is live (gating, strictness, hooks); these functions do the
setattr work on the ``TargetState`` table it hands them, compose each chain
(``portspeed.patching.chain``) and rebind stale aliases (``portspeed.patching.rebind``).

- ``resolve_records`` finds each record's owner object when its module is imported; a target
  that is missing marks its record "skipped" (upstream drift).
- ``install_many`` composes and sets each target, then sweeps aliases once; under
  PORTSPEED_STRICT=1 a failed install puts back what this batch installed and raises
  ``StrictViolation``.
- ``uninstall_many`` restores originals and every alias of the installed chains.
"""

from __future__ import annotations

import logging
import types
from typing import Any, Iterable

from portspeed import config
from portspeed.patching.chain import compose
from portspeed.patching.rebind import sweep
from portspeed.patching.record import REPLACE
from portspeed.patching.status import PatchRecord
from portspeed.patching.targets import MISSING, TargetState, put_back, raw_attribute, resolve_target
from portspeed.versions import gate_version

__all__ = ["StrictViolation", "install_many", "live_by_target", "mark", "resolve_records", "uninstall_many"]

log = logging.getLogger("portspeed.patches")

#: target name -> its bookkeeping (the manager owns the table; these functions fill and read it)
Targets = dict[str, TargetState]


class StrictViolation(Exception):
    """A batch hit skipped/failed patches under PORTSPEED_STRICT=1 (the manager turns it into PatchStrictError)."""

    def __init__(self, records: list[PatchRecord]) -> None:
        super().__init__()
        self.records = records


def mark(r: PatchRecord, status: str, detail: str) -> None:
    """Set a record to skipped/failed and say so in the log (such a patch is never silent)."""
    r.status, r.detail = status, detail
    log.warning("portspeed patch %s %s: %s", r.patch.name, status, detail)


def resolve_records(table: Targets, module: types.ModuleType, records: list[PatchRecord],
                    new_targets: list[str]) -> list[str]:
    """Find each record's owner object in ``module``; records whose target is missing become skipped.

    Targets seen for the first time (or not installed now) get a fresh ``TargetState`` in
    ``table`` and are appended to ``new_targets`` (so a rolled-back batch can forget them).
    """
    targets: list[str] = []
    for r in records:
        p = r.patch
        try:
            owner, attr = resolve_target(module, p.attr_path)
        except AttributeError as exc:
            mark(r, "skipped", f"target {p.target} not found{_where(p.distribution)}: {exc}; the upstream "
                               "code moved, so this patch needs updating for this version")
            continue
        st = table.get(p.target)
        if st is None or (st.installed_value is MISSING and p.target not in targets):
            # not installed now: (re)read the original, the module may have been reloaded
            raw, own = raw_attribute(owner, attr)
            table[p.target] = TargetState(target=p.target, owner=owner, attr=attr, had_own=own,
                                          original_raw=raw, original_value=getattr(owner, attr))
            new_targets.append(p.target)
        if p.target not in targets:
            targets.append(p.target)
    return targets


def _where(distribution: str | None) -> str:
    """' in megatron-core 0.16.1' (or what is known of the version) for a skip message."""
    if not distribution:
        return ""
    gv = gate_version(distribution)
    if gv is not None and gv.version is not None:
        return f" in {gv.describe(distribution)}"
    return f" ({distribution} version unknown)"


def live_by_target(records: Iterable[PatchRecord], targets: Iterable[str]) -> dict[str, list[PatchRecord]]:
    """Pending/applied records of each target, in chain order (replacement first, then wrappers)."""
    wanted: dict[str, list[PatchRecord]] = {t: [] for t in targets}
    for r in records:
        rs = wanted.get(r.patch.target)
        if rs is not None and r.status in ("pending", "applied"):
            rs.append(r)
    for rs in wanted.values():
        rs.sort(key=lambda r: (r.patch.kind != REPLACE, r.patch.order, r.seq))
    return wanted


def install_many(table: Targets, records: Iterable[PatchRecord], targets: list[str], full_sweep: bool,
                 since: str | None = None) -> None:
    """Install several targets, then rebind stale references in one sweep; all or nothing under strict.

    A target with no live record left is uninstalled (its last patch was removed or disabled).
    """
    live = live_by_target(records, targets)
    drop = [t for t in targets if not live[t]]
    done: list[tuple[TargetState, Any, Any, tuple[str, ...]]] = []
    failed: list[PatchRecord] = []
    replaced: dict[int, tuple[Any, TargetState]] = {}
    for target in targets:
        rs = live[target]
        if not rs:
            continue
        st = table[target]
        snapshot = (st, st.installed_raw, st.installed_value, st.chain)
        try:
            new_raw, chain = compose(st, rs)
            setattr(st.owner, st.attr, new_raw)
            new_value = getattr(st.owner, st.attr)
        except Exception as exc:
            for r in rs:
                mark(r, "failed", f"installing on {target} raised {type(exc).__name__}: {exc}")
            failed += rs
            continue
        done.append(snapshot)
        previous = st.installed_value
        for r in rs:
            r.status, r.detail = "applied", ""
        st.chain, st.installed_raw, st.installed_value = chain, new_raw, new_value
        for old in (st.original_value, previous):
            # None: an empty slot, not a stale alias
            if old is not MISSING and old is not None and old is not new_value:
                replaced[id(old)] = (old, st)
    if failed and config.settings().strict:
        for st, old_raw, old_value, old_chain in reversed(done):
            put_back(st, old_raw)
            st.installed_raw, st.installed_value, st.chain = old_raw, old_value, old_chain
        raise StrictViolation(failed)
    if drop:
        uninstall_many(table, drop)
    if replaced:
        sweep(replaced, full_sweep=full_sweep, since=since)


def uninstall_many(table: Targets, targets: list[str]) -> None:
    """Restore originals of ``targets`` and every alias of their installed chains, in one sweep."""
    restored: dict[int, tuple[Any, TargetState]] = {}
    for target in targets:
        st = table.get(target)
        if st is None or st.installed_value is MISSING:
            continue
        installed = st.installed_value
        put_back(st, MISSING)
        for ns, key, _label in st.rebound:
            if ns.get(key) is installed:
                ns[key] = st.original_value
        st.rebound.clear()
        st.installed_raw = st.installed_value = MISSING
        st.chain = ()
        restored[id(installed)] = (installed, st)
    if restored:
        # aliases taken after patching (`from x import f` once patched) go back too
        sweep(restored, full_sweep=True, since=None, restoring=True)
