"""Every patch range narrower than the supported one says why, and the why is checked.

Two kinds (``portspeed.patching.narrowing``): an upstream fact, whose edge must coincide with a
release where the watched source's recorded fingerprint appears, disappears or changes
(``fingerprints.WATCHED``, written by ``portspeed patches --check GITDIR@TAG --record``; no
Megatron-LM checkout needed here), and "not run there", which gets one line at activation for a
supported release it leaves out.
"""

from __future__ import annotations

import logging

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from portspeed.patching.gate import VersionCache, check_versions, gate
from portspeed.patching.narrowing import KINDS, NOT_RUN, UPSTREAM, NarrowRange
from portspeed.patching.record import Patch
from portspeed.patches.megatron import fingerprints, ranges
from portspeed.versions import SUPPORTED, GateVersion


def _edges(rng: str) -> list[Version]:
    """The releases where ``rng`` starts or stops, leaving out the floor it shares with CORE."""
    floor = Version(ranges.CORE.lstrip(">="))
    return [Version(s.version) for s in SpecifierSet(rng)
            if s.operator in (">=", ">", "<", "<=") and Version(s.version) != floor]


def test_every_narrowed_range_says_why_and_what_shows_it() -> None:
    assert ranges.NARROWED, "no narrowed range: the check below would check nothing"
    for rng in ranges.NARROWED:
        assert isinstance(rng, NarrowRange) and rng.kind in KINDS
        assert rng.reason.strip() and rng.evidence.strip()
        if rng.kind == UPSTREAM:
            assert rng.watch, f"{rng!r}: an upstream fact names the source that shows it"
            assert ":" in rng.evidence and " at core_v" in rng.evidence, (
                f"{rng!r}: the evidence names a source line at a tag: {rng.evidence!r}")
        assert _edges(rng), f"{rng!r} is not narrower than {ranges.CORE!r}"


def test_upstream_edges_coincide_with_recorded_fingerprint_changes() -> None:
    """At each edge the watched source differs between the recorded releases either side of it."""
    for rng in (r for r in ranges.NARROWED if r.kind == UPSTREAM):
        for edge in _edges(rng):
            moved = []
            for watch in rng.watch:
                recorded = fingerprints.WATCHED.get(watch, {})
                before = [Version(r) for r in recorded if Version(r) < edge]
                after = [Version(r) for r in recorded if Version(r) >= edge]
                assert before and after, (
                    f"{rng!r}: no recorded release of {watch} on both sides of {edge} (recorded: {sorted(recorded)}); "
                    f"record them with `portspeed patches --check GITDIR@TAG --record`")
                if recorded[str(max(before))] != recorded[str(min(after))]:
                    moved.append(watch)
            assert moved, (f"{rng!r} ({rng.reason}): none of {rng.watch} appears, disappears or changes at {edge}; "
                           f"the edge is not where the upstream fact is")


def _patch(versions: str) -> Patch:
    return Patch(name="test.narrow", target="megatron.core.mod:f", kind="wrap", impl=lambda w, i, a, k: w(*a, **k),
                 reason="test", distribution="megatron-core", versions=versions)


def _cache(release: str) -> VersionCache:
    cache = VersionCache()
    cache["megatron-core"] = GateVersion(Version(release), "/checkout/megatron/core", Version("0.16.1"))
    return cache


NOT_RUN_RANGE = NarrowRange(">=0.16", kind=NOT_RUN, reason="checked on 0.16 and later only",
                            evidence="the stock matrix run of 2026-11-26")


def test_a_supported_release_outside_a_not_run_range_gets_one_line(caplog: pytest.LogCaptureFixture) -> None:
    assert Version("0.15.3") in SpecifierSet(SUPPORTED["megatron-core"])
    cache, said = _cache("0.15.3"), set()
    status, why = gate(_patch(NOT_RUN_RANGE), settings=_Settings(), accelerator=lambda: None, versions=cache)
    assert status == "inactive" and "not run there" in why and "the stock matrix run" in why
    caplog.set_level(logging.WARNING, logger="portspeed.patches")
    check_versions(cache, said)
    check_versions(cache, said)  # said once per process
    lines = [r.getMessage() for r in caplog.records if "test.narrow" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "0.15.3" in lines[0] and "'>=0.16'" in lines[0] and "the stock matrix run" in lines[0]


def test_upstream_facts_and_unsupported_releases_stay_silent(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="portspeed.patches")
    upstream = NarrowRange(">=0.16", kind=UPSTREAM, reason="f appears in 0.16", evidence="mod.py:1 at core_v0.16.1",
                           watch=("megatron.core.mod:f",))
    for versions, release in ((upstream, "0.15.3"), (NOT_RUN_RANGE, "0.14.0")):
        cache = _cache(release)
        status, _ = gate(_patch(versions), settings=_Settings(), accelerator=lambda: None, versions=cache)
        assert status == "inactive" and cache.untested == []
        check_versions(cache, set())
    assert not [r for r in caplog.records if "test.narrow" in r.getMessage()]


def test_a_narrow_range_must_say_why() -> None:
    with pytest.raises(ValueError, match="kind"):
        NarrowRange(">=0.16", kind="belief", reason="r", evidence="e")
    with pytest.raises(ValueError, match="evidence"):
        NarrowRange(">=0.16", kind=NOT_RUN, reason="r", evidence=" ")
    with pytest.raises(ValueError, match="watch"):
        NarrowRange(">=0.16", kind=UPSTREAM, reason="r", evidence="e")
    with pytest.raises(ValueError, match="starts before"):
        ranges.narrowed(">=0.14", "r", kind=NOT_RUN, evidence="e")


class _Settings:
    """The one setting gate() reads."""

    @staticmethod
    def is_disabled(name: str) -> bool:
        return False
