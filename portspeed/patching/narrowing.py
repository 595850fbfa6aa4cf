"""A patch range narrower than the supported one, carrying why it is narrow.

Why: a range is a promise. Every release inside ``versions.SUPPORTED`` that a patch's range
leaves out is left out for one of two reasons, and the two are handled differently:

- ``UPSTREAM``: the target appears, disappears or is fixed upstream at the range's edge (the
  patch has nothing to do outside it). Silent at activation; the edge must coincide with a
  release where the watched source's fingerprint appears, disappears or changes
  (``portspeed patches --check SOURCE --record`` records them; a CI test compares).
- ``NOT_RUN``: the patch was never run on the releases outside it. A release inside the
  supported range but outside such a range gets one log line at activation (the patch, the
  release, the range), so a gap is never silent.

A ``NarrowRange`` is still the PEP 440 string every gate reads (``Patch.versions``); the
reason travels with it. Example::

    OFFLOAD = NarrowRange(">=0.16", kind=UPSTREAM, reason="offload_to_cpu first appears in 0.16",
                          evidence="megatron/core/distributed/param_and_grad_buffer.py:964 at core_v0.16.1",
                          watch=("megatron.core.distributed.param_and_grad_buffer:"
                                 "_ParamAndGradBuffer.offload_to_cpu",))
"""

from __future__ import annotations

__all__ = ["KINDS", "NOT_RUN", "UPSTREAM", "NarrowRange"]

#: the target appears, disappears or is fixed upstream at the range's edge: silent
UPSTREAM = "upstream"
#: the patch was not run on the releases outside the range: one line at activation
NOT_RUN = "not run there"
KINDS = (UPSTREAM, NOT_RUN)


class NarrowRange(str):
    """A version range (a ``str``, as ``Patch.versions`` needs) with its kind, reason and evidence.

    ``evidence`` names the run or the source line that shows the reason; ``watch`` names the
    ``module:attr`` sources whose recorded fingerprints show an ``UPSTREAM`` edge (a top-level
    script counts as a module: ``pretrain_gpt:get_batch``).
    """

    kind: str
    reason: str
    evidence: str
    watch: tuple[str, ...]

    def __new__(cls, spec: str, *, kind: str, reason: str, evidence: str, watch: tuple[str, ...] = ()) -> NarrowRange:
        if kind not in KINDS:
            raise ValueError(f"range {spec!r}: kind {kind!r} is not one of {KINDS}")
        if not reason.strip() or not evidence.strip():
            raise ValueError(f"range {spec!r}: say why it is narrow (reason) and what shows it (evidence)")
        if kind == UPSTREAM and not watch:
            raise ValueError(f"range {spec!r}: an upstream fact names the source that shows it (watch=)")
        self = super().__new__(cls, spec)
        self.kind, self.reason, self.evidence, self.watch = kind, reason, evidence, tuple(watch)
        return self

    def describe(self) -> str:
        """One phrase for logs: the kind, the reason and what shows it."""
        return f"{self.kind}: {self.reason} (shown by {self.evidence})"
