"""The ops one training step ran on the host, in one line, from a perf recording (``portspeed run --perf``).

Why: on a new PrivateUse1 device most of torch's ops run through torch's CPU fallback without a word (the
device registered no kernel for them: each call copies its tensors to the host and back), and portspeed's host
rung computes on the host the ops the adapter declared wrong (``wrong_torch_ops``). Both are correct and slow; a
vendor on day one wants the list, most calls first, to know which kernels to write. The perf recording already
counts them (its dispatch mode on a PrivateUse1 device: each part's ``fallbacks``; the line's ``host_rung``), so
this module only sums one iteration of one rank over its modules and words it; conformance's training suite and
``portspeed compare --perf RUN`` print the same line.
"""

from __future__ import annotations

from typing import Any, Iterable

__all__ = ["PREFIX", "fallback_line", "run_line", "step_counts"]

PREFIX = "host fallbacks in one training step"


def _sum(tables: Iterable[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for table in tables:
        for op, n in table.items():
            out[op] = out.get(op, 0) + int(n)
    return out


def step_counts(line: dict[str, Any]) -> tuple[dict[str, int], dict[str, int]]:
    """The CPU-fallback ops of one recorded iteration (its parts' ``fallbacks`` summed) and the host rung's
    (``host_rung``: the aten ops portspeed computed on the host), each op -> calls."""
    return _sum(p.get("fallbacks") or {} for p in line.get("parts", [])), dict(line.get("host_rung") or {})


def _listed(counts: dict[str, int]) -> str:
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return ", ".join(f"{op} x{n}" for op, n in ranked)


def fallback_line(line: dict[str, Any], where: str = "") -> str:
    """One line naming the CPU-fallback ops of ``line`` (one iteration of one rank) with counts, most calls first,
    and, separately, what portspeed's host rung computed; ``where`` says which iteration and rank."""
    fallbacks, host = step_counts(line)
    head = f"{PREFIX}{f' ({where})' if where else ''}: "
    if fallbacks:
        text = (f"{head}{_listed(fallbacks)} ({len(fallbacks)} ops, {sum(fallbacks.values())} calls): the device "
                "registers no kernel for these, so torch ran each on the host through its CPU fallback (a copy to "
                "the host and back per call); register PrivateUse1 kernels for them, most calls first "
                "(TORCH_LIBRARY_IMPL(aten, PrivateUse1, m))")
    else:
        text = f"{head}none"
    if host:
        text += (f"; computed on the host by portspeed because the adapter declares them wrong (wrong_torch_ops): "
                 f"{_listed(host)} ({sum(host.values())} calls): fix the device's kernels, then take them out")
    return text


def run_line(lines: dict[tuple[int, int], dict[str, Any]]) -> str | None:
    """The line of a recording (``PerfRun.lines``: its first iteration on its lowest rank), or None when that
    iteration ran nothing on the host (a device with every kernel, or one whose fallbacks are not watched)."""
    if not lines:
        return None
    iteration, rank = min(lines, key=lambda k: (k[1], k[0]))
    fallbacks, host = step_counts(lines[(iteration, rank)])
    if not fallbacks and not host:
        return None
    return fallback_line(lines[(iteration, rank)], f"iteration {iteration}, rank {rank}")
