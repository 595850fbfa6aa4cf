"""What happened to each patch: the statuses a report shows, and the record behind each row."""

from __future__ import annotations

import dataclasses
from typing import Any

from portspeed.patching.record import Patch

__all__ = ["PatchRecord", "STATUSES"]

#: Every status a patch can be in, as shown by the report.
STATUSES = ("registered", "pending", "applied", "skipped", "inactive", "disabled", "failed", "reverted")


@dataclasses.dataclass
class PatchRecord:
    """What happened to one patch; the report is a list of these."""

    patch: Patch
    seq: int
    status: str = "registered"
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        """The record as plain data (what `portspeed patches` prints)."""
        p = self.patch
        return {
            "name": p.name,
            "target": p.target,
            "kind": p.kind,
            "status": self.status,
            "detail": self.detail,
            "reason": p.reason,
            "distribution": p.distribution,
            "versions": p.versions,
            "order": p.order,
        }
