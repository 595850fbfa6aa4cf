"""The link bandwidth table: what each collective moves per second on one host's CCL, by message and group size.

Why a table apart from the recording: a recording says what a training run's collectives achieved; whether
that is slow needs what the same link can do. ``portspeed conformance --suites bandwidth`` measures it, as
nccl-tests does (a few message sizes per collective and group size, algorithm bandwidth ``bytes / time`` and
bus bandwidth ``algbw x factor``), and writes one entry per (adapter, backend, host) into one JSON file
(``PORTSPEED_BANDWIDTH``, ``--bandwidth``; default ``~/.cache/portspeed/bandwidth.json``); ``portspeed compare
--perf`` picks the entry of RUN's adapter, backend and host and prints, beside each collective's achieved bus
bandwidth, the one measured at the nearest message size of the same collective and group size::

    {"format": "portspeed-bandwidth", "version": 1,
     "links": [{"adapter": "cpu", "device_type": "cpu", "backend": "gloo", "host": "node1", "torch": "2.13.0",
                "measured": "2026-11-29T16:30:00Z", "warmup": 5, "iterations": 20,
                "rows": [{"op": "all_reduce", "ranks": 2, "bytes": 1024, "dtype": "float32", "time_us": 80.1,
                          "algbw_gbs": 0.0128, "busbw_gbs": 0.0128}, ...]}, ...]}

Nothing here imports torch (the parity layer reads and writes files only).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Sequence

from portspeed.perf.reading.recordings import PerfInputError, PerfRun, median

__all__ = ["FORMAT", "VERSION", "FAMILIES", "bus_factor", "collectives_table", "default_path", "family", "find_link",
           "measured", "read_table", "run_link", "write_link"]

FORMAT, VERSION = "portspeed-bandwidth", 1
#: the collectives measured, as nccl-tests names them
FAMILIES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
_KEY = ("adapter", "backend", "host")


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' factor from algorithm to bus bandwidth for ``op`` on ``n`` ranks."""
    if n < 2:
        return 0.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op.startswith(("all_gather", "reduce_scatter", "all_to_all")):
        return (n - 1) / n
    return 1.0


def family(op: str) -> str | None:
    """The measured collective a recorded call is compared with (``all_gather_into_tensor`` -> ``all_gather``)."""
    for name in FAMILIES:
        if op == name or op.startswith(name + "_"):
            return name
    return None


def default_path() -> str:
    """``PORTSPEED_BANDWIDTH``, else ``$XDG_CACHE_HOME/portspeed/bandwidth.json`` (``~/.cache`` without it)."""
    from portspeed import config

    got = config.settings().bandwidth_file
    if got:
        return str(got)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "portspeed", "bandwidth.json")


def read_table(path: str) -> list[dict[str, Any]]:
    """Every link of the table at ``path`` ([] when there is no file); PerfInputError naming what is damaged."""
    if not os.path.exists(path):
        return []
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except ValueError:
        raise PerfInputError(f"{path} is not JSON; measure again with `portspeed conformance --suites bandwidth` "
                             "or remove it") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
        raise PerfInputError(f"{path} is not a portspeed link bandwidth table ({FORMAT!r} version {VERSION}); "
                             "give another --bandwidth file or remove it")
    links = data.get("links")
    if not isinstance(links, list) or not all(isinstance(k, dict) and isinstance(k.get("rows"), list)
                                              for k in links):
        raise PerfInputError(f"{path}: its links lack their rows; measure again or remove it")
    return links


def write_link(path: str, link: dict[str, Any]) -> None:
    """Put ``link`` into the table at ``path``, replacing the entry of the same adapter, backend and host."""
    links = [k for k in read_table(path) if tuple(k.get(f) for f in _KEY) != tuple(link[f] for f in _KEY)]
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"format": FORMAT, "version": VERSION, "links": [*links, link]}, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)  # a reader never sees half a table


def find_link(links: Sequence[dict[str, Any]], adapter: str | None, backend: str | None,
              host: str | None) -> dict[str, Any] | None:
    """The entry measured for this adapter, backend and host (None: not measured there)."""
    for link in links:
        if (link.get("adapter"), link.get("backend"), link.get("host")) == (adapter, backend, host):
            return link
    return None


def measured(link: dict[str, Any], op: str, ranks: int, nbytes: int) -> dict[str, Any] | None:
    """The row of ``link`` for ``op``'s collective on ``ranks`` ranks at the message size nearest ``nbytes`` (on a
    log scale), or None when that collective and group size were not measured."""
    name = family(op)
    rows = [r for r in link["rows"] if r.get("op") == name and r.get("ranks") == ranks and r.get("bytes", 0) > 0]
    if not rows:
        return None
    size = max(1, nbytes)
    return min(rows, key=lambda r: abs(math.log2(r["bytes"] / size)))


def run_link(run: PerfRun) -> tuple[str | None, str | None, str | None]:
    """(adapter, backend, host) of RUN's lowest rank's first line (None where the recording does not say)."""
    if not run.lines:
        return None, None, None
    line = run.lines[min(run.lines, key=lambda k: (k[1], k[0]))]
    return line.get("adapter"), line.get("backend"), line.get("host")


def _link_note(run: PerfRun, path: str, link: dict[str, Any] | None) -> str:
    adapter, backend, host = run_link(run)
    if link is not None:
        return (f"link: {path}, measured {link.get('measured', '?')} by `portspeed conformance --suites bandwidth` "
                f"(adapter {adapter}, backend {backend}, host {host}), at the nearest message size measured")
    if adapter is None:
        return "link: RUN's recording does not name its adapter, backend and host; nothing to look up"
    return (f"link: no bandwidth measured for adapter {adapter}, backend {backend} on host {host} in {path}; run "
            f"`portspeed conformance --adapter {adapter} --suites bandwidth` on that host")


def collectives_table(run: PerfRun, path: str, links: list[dict[str, Any]]) -> list[str]:
    """Per (op, group size, bytes, dtype): calls, time, wait for the last rank, transfer, achieved bus bandwidth, and
    the bus bandwidth measured on RUN's link (``links``: the table read from ``path``), then a note on it."""
    link = find_link(links, *run_link(run))
    rows: dict[tuple, list[tuple[float, float, float]]] = {}
    for it in run.iterations:
        for m in run.matches(it):
            for r, c in m.calls.items():
                transfer = m.transfer_ms(r)
                if transfer is None:
                    continue
                key = (m.op, len(m.group), int(c.get("bytes") or 0), c.get("dtype"))
                rows.setdefault(key, []).append(((c["leave"] - c["enter"]) * 1e3, m.wait_ms(r), transfer))
    out = ["op                        ranks       bytes  dtype      calls  time ms  wait ms  xfer ms  busbw GB/s  "
           "link GB/s  (at bytes)  of link"]
    for (op, n, nbytes, dtype), got in sorted(rows.items(), key=lambda kv: -sum(t for t, _, _ in kv[1])):
        t, w, x = (median([g[i] for g in got]) for i in range(3))
        bw = nbytes / (x / 1e3) / 1e9 * bus_factor(op, n) if x > 0 else 0.0
        row = measured(link, op, n, nbytes) if link is not None else None
        if row is not None and row.get("busbw_gbs"):
            ref = float(row["busbw_gbs"])
            vs = f"{ref:>9.3f}  {int(row['bytes']):>10}  {100.0 * bw / ref:>6.0f}%"
        else:
            vs = f"{'-':>9}  {'-':>10}  {'-':>7}"
        out.append(f"{op:<24}  {n:>5}  {nbytes:>10}  {str(dtype):<9}  {len(got):>5}  {t:>7.3f}  {w:>7.3f}  "
                   f"{x:>7.3f}  {bw:>10.3f}  {vs}")
    if len(out) == 1:
        return ["(no collective was recorded by every rank of its group)"]
    return [*out, _link_note(run, path, link)]
