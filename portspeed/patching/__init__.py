"""The patch engine: declared changes to framework objects, applied lazily, composably, reversibly.

Layer: engine. Imports only the foundation (``errors``, ``config``, ``versions``), and the selected
adapter only to hand it to a patch's ``when=`` condition; it knows nothing of collectives
or frameworks. Patches are data (``Patch`` records) that the integrations register.

- ``record``   ``Patch``: one frozen description of one change (replace, wrap, or an import finder).
- ``status``   ``PatchRecord`` and ``STATUSES``: what happened to each patch (the report's rows).
- ``gate``     ``gate()``: whether a patch applies here; the manager and `portspeed info` both call it.
- ``targets``  resolving ``"pkg.mod:Qual.attr"``, remembering the original, putting it back.
- ``chain``    ``compose()``: the installed object, from the original and the live patches in order.
- ``rebind``   the identity sweep over aliases, and the audit of references it cannot reach.
- ``install``  the setattr work: resolve records, install a batch of targets, uninstall them.
- ``hooks``    post-import hooks (wrapt), retired as a whole on revert.
- ``finders``  finder patches on ``sys.meta_path``.
- ``manager``  ``PatchManager``: registration, gating, strict batches, revert, scoped use, report.
- ``drift``    upstream drift: patch targets missing or changed in a Megatron source.
"""

from __future__ import annotations

from portspeed.lazy import lazy_exports

_PUBLIC = {
    "Patch": ".record",
    "REPLACE": ".record",
    "WRAP": ".record",
    "PatchManager": ".manager",
    "PatchRecord": ".status",
    "STATUSES": ".status",
}
__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC)
