"""Results of the conformance checks: one record per check, and how they are printed."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable

__all__ = ["Check", "Report"]


@dataclasses.dataclass(frozen=True)
class Check:
    """One check: its suite, its name (the rule it tests), whether it held, and why not."""

    suite: str
    name: str
    ok: bool
    detail: str = ""
    skipped: bool = False


@dataclasses.dataclass
class Report:
    """The checks of one run of the kit, for one adapter."""

    adapter: str
    checks: list[Check] = dataclasses.field(default_factory=list)
    #: declarations a failed check asks for: attribute -> its value as Python source (printed last, to paste)
    paste: dict[str, str] = dataclasses.field(default_factory=dict)
    #: the adapter class the lines go into (named in the heading)
    adapter_class: str = ""
    #: what a suite found that is no pass or fail (the host fallbacks of a training step), printed after the checks
    notes: list[str] = dataclasses.field(default_factory=list)

    def note(self, line: str) -> None:
        """A finding to print as its own line after the checks (neither a pass nor a failure)."""
        self.notes.append(line)

    def declare(self, name: str, value: str) -> None:
        """Ask for ``name = value`` in the adapter class (a failed check found what it must say)."""
        self.paste[name] = value

    def add(self, suite: str, name: str, ok: bool, detail: str = "") -> None:
        self.checks.append(Check(suite, name, bool(ok), "" if ok else detail))

    def skip(self, suite: str, name: str, why: str) -> None:
        self.checks.append(Check(suite, name, True, why, skipped=True))

    def run(self, suite: str, name: str, fn: Callable[[], Any]) -> None:
        """Run ``fn``; an AssertionError or any exception fails the check with its message."""
        try:
            fn()
        except Exception as exc:  # a check that raises is a failed check, reported by name
            self.add(suite, name, False, f"{type(exc).__name__}: {exc}")
        else:
            self.add(suite, name, True)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    def summary_line(self) -> str:
        passed = sum(1 for c in self.checks if c.ok and not c.skipped)
        skipped = sum(1 for c in self.checks if c.skipped)
        line = f"{passed} passed, {len(self.failed)} failed"
        return line + (f", {skipped} skipped" if skipped else "")

    def render(self) -> str:
        lines = [f"portspeed conformance: adapter {self.adapter!r}"]
        for c in self.checks:
            mark = "skip" if c.skipped else ("ok" if c.ok else "FAIL")
            lines.append(f"  [{mark:>4}] {c.suite}: {c.name}" + (f" -- {c.detail}" if c.detail else ""))
        lines.extend(self.notes)
        lines.append("conformance: " + self.summary_line())
        if self.paste:
            where = f"the adapter class {self.adapter_class}" if self.adapter_class else "the adapter class"
            lines.append(f"paste these lines into {where} (the body, indented as shown), then run conformance again:")
            lines.extend(f"    {name} = {value}" for name, value in self.paste.items())
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps({"adapter": self.adapter, "checks": [dataclasses.asdict(c) for c in self.checks],
                           "paste": self.paste, "notes": self.notes}, indent=1)
