"""A pytest plugin each rank of `portspeed megatron-tests` loads: per file, its outcomes and time, one JSON per rank.

Why: Megatron-LM's CI launches a whole folder per torchrun (a bucket), and so does the
runner, because starting 8 ranks (8 imports of torch, Megatron and pytest) costs more than
many of the files' tests on a small machine. The per-file figures (passed / failed /
skipped / errors and seconds) therefore come from inside the run: this plugin sums
pytest's own reports per test file (setup + call + teardown durations) and writes them,
with the session's wall time, to ``$PORTSPEED_RANK_REPORT_DIR/rank<RANK>.json`` when the
session ends. A test's outcome is its worst phase (an error in setup or teardown counts as
an error, as pytest's summary counts it). Inactive unless that variable is set.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

__all__ = ["REPORT_ENV", "RankReport"]

#: the folder the reports go to (set by the runner for the ranks)
REPORT_ENV = "PORTSPEED_RANK_REPORT_DIR"


class RankReport:
    """Collects per-file outcomes and durations for one rank's pytest session."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.start = time.monotonic()
        self.collected_at: float | None = None
        self.tests: dict[str, dict[str, Any]] = {}

    def pytest_collection_finish(self, session: Any) -> None:
        self.collected_at = time.monotonic()

    def pytest_runtest_logreport(self, report: Any) -> None:
        entry = self.tests.setdefault(report.nodeid, {"outcome": "passed", "seconds": 0.0})
        entry["seconds"] += float(getattr(report, "duration", 0.0) or 0.0)
        if report.when == "call":
            if report.skipped:
                entry["outcome"] = "xfailed" if hasattr(report, "wasxfail") else "skipped"
            elif report.failed:
                entry["outcome"] = "failed"
        elif report.skipped and report.when == "setup":
            entry["outcome"] = "skipped"
        elif report.failed and entry["outcome"] != "failed":
            entry["outcome"] = "errors"

    def files(self) -> dict[str, dict[str, Any]]:
        """file -> {outcome: count, 'seconds': sum of its tests' phases}."""
        out: dict[str, dict[str, Any]] = {}
        for nodeid, entry in self.tests.items():
            f = out.setdefault(nodeid.split("::", 1)[0], {"seconds": 0.0})
            f[entry["outcome"]] = f.get(entry["outcome"], 0) + 1
            f["seconds"] = round(f["seconds"] + entry["seconds"], 2)
        return out

    def pytest_sessionfinish(self, session: Any, exitstatus: int) -> None:
        end = time.monotonic()
        data = {"rank": int(os.environ.get("RANK", "0")), "exitstatus": int(exitstatus),
                "session_seconds": round(end - self.start, 2),
                "collect_seconds": round((self.collected_at or end) - self.start, 2),
                "deselected": len(getattr(session.config, "_portspeed_deselected", [])),
                "files": self.files(),
                "failed_tests": sorted(n for n, e in self.tests.items() if e["outcome"] in ("failed", "errors"))}
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"rank{data['rank']}.json").write_text(json.dumps(data, indent=1))


def pytest_deselected(items: list) -> None:
    if items:
        cfg = items[0].config
        cfg._portspeed_deselected = getattr(cfg, "_portspeed_deselected", []) + [i.nodeid for i in items]


def pytest_configure(config: Any) -> None:
    out = os.environ.get(REPORT_ENV)
    if out:
        config.pluginmanager.register(RankReport(Path(out)), "portspeed-rank-report")
