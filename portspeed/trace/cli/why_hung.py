"""`portspeed why-hung DIR`: read every rank's flight-recorder dump and name, in one line, why the job hung.

Why: a hung job leaves one dump per rank (``portspeed.trace.flight_recorder``, or torch's own flight
recorder); the answer is in how the ranks' sequences of collectives stop agreeing, which is
tedious to find by hand and easy to find by machine.

Reads, in DIR: portspeed's dumps (``portspeed_trace_rank_<R>``), torch's (any pickle holding
``pg_config``, named ``<prefix><R>``: ``torch_fr_trace_rank_<R>`` on NCCL under portspeed), and
for a rank with no dump its write-through file (``portspeed_last_calls_<R>.txt``: every call it
issued, so a rank that died hard still shows its last one). One recorder's numbering for all
ranks: portspeed's where it covers as many ranks as torch's; on torch >= 2.15, where torch records
Gloo's collectives and the hooked backends' calls and portspeed the rest, both together
(``trace_dumps``: each call once). A CCL's staging group
(``portspeed.trace.staging``) is never the cause; a rank stuck in one is shown in the
evidence. Then, group by group, in this order, the first finding is the cause:

1. at the lowest collective sequence number where the ranks disagree: another op (op
   mismatch), other input sizes or dtypes (shape / dtype mismatch), another call site (a
   desync: a rank skipped or added a collective and the backend paired the wrong calls; not
   when all issued as many and the last ones agree again: rank-dependent lines on purpose);
   of several groups, the divergence issued first; each with the call site the odd rank
   issued fewer calls from (the skipped call);
2. a point-to-point send with no matching receive (or a receive with no send, or the k-th
   send and receive of a pair with other shapes);
3. ranks that never issued collective #N that others issued (and their last entry);
4. a straggler: one rank entered a collective ``STRAGGLER_S`` seconds or more after the rest;
5. a rank of a group that left nothing to read.

Exit status: 0 a cause was found, 1 the dumps show no divergence (it says so), 2 unreadable
input (no folder, no dump, a dump that does not load).
"""

from __future__ import annotations

import dataclasses
import re
import sys
from typing import Any

from portspeed.trace.dumps import Unreadable, load
from portspeed.trace.dumps import call_site as _site
from portspeed.trace.dumps import op_name as _op
from portspeed.trace.dumps import ranks_of as _ranks_of

__all__ = ["Finding", "Unreadable", "load", "analyse", "answer", "main", "STRAGGLER_S"]

#: a rank that enters a collective this many seconds after the rest is named a straggler
STRAGGLER_S = 2.0
#: collectives whose inputs must be alike on every rank (gather / scatter / all_to_all_single differ by design)
_UNIFORM = {"all_reduce", "reduce", "broadcast", "all_gather", "_all_gather_base", "reduce_scatter",
            "_reduce_scatter_base", "all_gather_single", "reduce_scatter_single", "barrier"}
@dataclasses.dataclass
class Finding:
    """The cause (one line) and the evidence (lines); ``found`` False when nothing diverged."""

    cause: str
    evidence: list[str]
    found: bool = True
    when: float = 0.0  # when the diverging call was issued (ns): of several groups' divergences, the first is the cause


# ---------------------------------------------------------------------- analysis
def _group_of(e: dict, cfgs: dict[int, dict]) -> tuple[str, str, tuple[int, ...]]:
    name, desc = (list(e.get("process_group") or ("?", "")) + [""])[:2]
    ranks = e.get("ps_ranks")
    if not ranks:
        for cfg in cfgs.values():
            ranks = _ranks_of(cfg, name)
            if ranks:
                break
    return str(name), str(desc), tuple(ranks or ())


def _gname(name: str, desc: str) -> str:
    return f"group {name}" + (f" ({desc})" if desc else "")


def _peer(e: dict, ranks: tuple[int, ...]) -> int:
    if isinstance(e.get("ps_peer"), int) and e["ps_peer"] >= 0:
        return e["ps_peer"]
    m = re.search(r"(\d+)(?:->|<-)(\d+)$", str(e.get("profiling_name", "")))
    if not m:
        return -1
    local = int(m.group(2))
    return ranks[local] if local < len(ranks) else local


def _describe(e: dict | None) -> str:
    if e is None:
        return "nothing recorded"
    kind = f"p2p #{e.get('p2p_seq_id')}" if e.get("is_p2p") else f"collective #{e.get('collective_seq_id')}"
    state = e.get("state", "?")
    return f"{_op(e)} ({kind} of group {(e.get('process_group') or ['?'])[0]}) at {_site(e)}, {state}"


def analyse(dumps: dict[int, dict]) -> Finding:
    """The first divergence in ``dumps`` (rank -> {"entries", "pg_config"}), or a Finding with found=False."""
    cfgs = {r: d.get("pg_config", {}) for r, d in dumps.items()}
    staged = {r: [e for e in d["entries"] if _staging(e)] for r, d in dumps.items()}
    dumps = {r: dict(d, entries=[e for e in d["entries"] if not _staging(e)]) for r, d in dumps.items()}
    last = {r: (d["entries"][-1] if d["entries"] else None) for r, d in dumps.items()}
    found = _first_finding(dumps, cfgs, last)
    inside = [f"rank {r}: inside its CCL's staging group: {_op(x)} {'to' if _op(x) == 'send' else 'from'} rank "
              f"{x.get('ps_peer')} {x.get('input_sizes')} (group {x['process_group'][0]}, under collective "
              f"#{x.get('collective_seq_id')}), {x.get('state')}" for r, s in sorted(staged.items()) for x in s[-1:]
              if x.get("state") != "completed"]
    found.evidence += inside
    return found


def _staging(e: dict) -> bool:
    """A call of a CCL's inner staging group (portspeed.trace.staging): evidence, never the cause."""
    name = str((e.get("process_group") or ("",))[0])
    return bool(e.get("ps_staging")) or name.endswith("/staging") or name.startswith("staging:")


def _first_finding(dumps: dict[int, dict], cfgs: dict[int, dict], last: dict) -> Finding:
    colls: dict[tuple, dict[int, dict[int, dict]]] = {}  # group -> rank -> seq -> entry
    p2p: dict[tuple, dict[tuple[int, int], dict[str, list]]] = {}  # group -> (src, dst) -> send/recv entries
    members: set[int] = set()
    for r, d in dumps.items():
        for e in d["entries"]:
            g = _group_of(e, cfgs)
            members.update(g[2])
            if e.get("is_p2p") or _op(e) in ("send", "recv"):
                peer = _peer(e, g[2])
                pair = (r, peer) if _op(e) == "send" else (peer, r)
                p2p.setdefault(g, {}).setdefault(pair, {"send": [], "recv": []})[_op(e)].append(e)
            else:
                colls.setdefault(g, {}).setdefault(r, {})[int(e.get("collective_seq_id", 0))] = e
    issued = {r: max((int(e.get("record_id") or 0) for e in d["entries"]), default=0) for r, d in dumps.items()}
    diverged = [f for f in (_diverged(g, by_rank, last, issued) for g, by_rank in colls.items()) if f]
    if diverged:  # sequence numbers are per group: the divergence issued first is the cause
        return min(diverged, key=lambda f: f.when)
    for g, pairs in p2p.items():  # before the collectives a rank stuck in a send never reached
        found = _p2p(g, pairs, last)
        if found:
            return found
    for g, by_rank in colls.items():
        found = _never_issued(g, by_rank, dumps, last)
        if found:
            return found
    for g, by_rank in colls.items():
        found = _straggler(g, by_rank)
        if found:
            return found
    absent = sorted(members - set(dumps))
    if absent:
        return Finding(f"rank{'s' if len(absent) > 1 else ''} {', '.join(map(str, absent))} left no dump and no "
                       "write-through file: dead before recording anything, or run without PORTSPEED_TRACE",
                       [f"rank {r}: last entry {_describe(last[r])} ({dumps[r]['reason']})" for r in sorted(dumps)])
    total = sum(len(d["entries"]) for d in dumps.values())
    return Finding("no divergence: every rank issued the same collectives in the same order, with the same shapes, "
                   "from the same call sites", [f"{len(dumps)} ranks, {total} entries read"], found=False)


def _heals(by_rank: dict[int, dict[int, dict]], seq: int) -> bool:
    """Whether ranks whose call sites differ at ``seq`` (same op and shapes) took different lines on purpose:
    every rank issued as many collectives and the last ones came from the same site (Megatron's ``if rank == 0:
    build(); barrier() else: barrier(); build()``). A skip shifts every later pairing to the end, or leaves a rank
    one call short."""
    if len({max(s) for s in by_rank.values()}) > 1:
        return False
    last = max(set.intersection(*(set(s) for s in by_rank.values())))
    return last > seq and len({_site(s[last]) for s in by_rank.values()}) == 1


def _diverged(g: tuple, by_rank: dict[int, dict[int, dict]], last: dict, issued: dict[int, int]) -> Finding | None:
    name, desc, _ = g
    common = sorted(set.intersection(*(set(s) for s in by_rank.values()))) if len(by_rank) > 1 else []
    for seq in common:
        at = {r: by_rank[r][seq] for r in sorted(by_rank)}
        for what, key in (("op mismatch", _op), ("shape/dtype mismatch", _shape), ("desync", _site)):
            values = {r: key(e) for r, e in at.items()}
            if len(set(values.values())) < 2 or (what == "shape/dtype mismatch" and _op(at[min(at)]) not in _UNIFORM):
                continue
            if what == "desync" and _heals(by_rank, seq):
                break  # rank-dependent call sites (if rank == 0: barrier() else: barrier()) that agree again after
            odd = _odd_one(values, by_rank, issued)
            e = at[odd]
            where = f"collective #{seq} of {_gname(name, desc)}"
            if what == "desync":
                cause = (f"desync: rank {odd} issued {_op(e)} {where} from {_site(e)}, the others from "
                         f"{', '.join(sorted({v for r, v in values.items() if r != odd}))}: a rank skipped or added a "
                         "collective before it, and the backend paired the wrong calls")
            else:
                cause = (f"{what}: rank {odd} issued {_op(e)} {_shape(e) if what != 'op mismatch' else ''}"
                         f"{' ' if what != 'op mismatch' else ''}as {where} at {_site(e)}; the others "
                         + ", ".join(f"rank {r} {_op(x)} {_shape(x)} at {_site(x)}" for r, x in at.items() if r != odd))
            cause += _skipped(by_rank, odd, _reference(values, odd), seq)
            evidence = [f"rank {r}: #{seq} {_op(x)} {_shape(x)} at {_site(x)}, {x.get('state')}" for r, x in at.items()]
            evidence += [f"rank {r}: issued up to #{max(s)} of {_gname(name, desc)}; last entry {_describe(last[r])}"
                         for r, s in sorted(by_rank.items())]
            return Finding(cause, evidence, when=float(e.get("time_created_ns") or 0))
    return None


def _reference(values: dict[int, Any], odd: int) -> int:
    """A rank of the majority the odd one disagrees with."""
    others = [r for r in values if values[r] != values[odd]]
    return max(others, key=lambda r: (sum(v == values[r] for v in values.values()), -r))


def _skipped(by_rank: dict[int, dict[int, dict]], odd: int, ref: int, seq: int) -> str:
    """Where ``odd`` issued fewer calls than ``ref`` up to ``seq`` (call site by call site): the skipped call."""
    lo = max(min(s) for s in by_rank.values())

    def counts(r: int) -> dict[tuple[str, str], int]:
        out: dict[tuple[str, str], int] = {}
        for n in range(lo, seq + 1):
            e = by_rank[r].get(n)
            if e is not None:
                out[(_op(e), _site(e))] = out.get((_op(e), _site(e)), 0) + 1
        return out

    mine, theirs = counts(odd), counts(ref)
    fewer = [(k, theirs[k] - mine.get(k, 0), mine.get(k, 0), theirs[k]) for k in theirs if mine.get(k, 0) < theirs[k]]
    if not fewer:
        return ""
    return "; up to it, rank {} issued {}: the call it skipped or replaced".format(odd, ", ".join(
        f"{d} {op} fewer from {site} ({m} against rank {ref}'s {t} in #{lo}-#{seq})" for (op, site), d, m, t in fewer))


def _shape(e: dict) -> str:
    return f"in {e.get('input_sizes')} {e.get('input_dtypes')} out {e.get('output_sizes')} {e.get('output_dtypes')}"


def _odd_one(values: dict[int, Any], by_rank: dict[int, dict], issued: dict[int, int]) -> int:
    """The rank in the minority; on a tie the one that issued fewest collectives of the group (it skipped one),
    then the one that issued most calls in all (a rank that skipped a call went on: it is ahead)."""
    count: dict[Any, int] = {}
    for v in values.values():
        count[v] = count.get(v, 0) + 1
    return min(values, key=lambda r: (count[values[r]], max(by_rank[r]), -issued.get(r, 0), -r))


def _never_issued(g: tuple, by_rank: dict[int, dict[int, dict]], dumps: dict, last: dict) -> Finding | None:
    name, desc, ranks = g
    tops = {r: max(s) for r, s in by_rank.items()}
    for r in ranks:  # a member with a dump but no collective of this group at all
        if r in dumps and r not in tops:
            tops[r] = 0
    if len(set(tops.values())) < 2:
        return None
    high = max(tops.values())
    behind = sorted(r for r, t in tops.items() if t < high)
    ahead = min(r for r, t in tops.items() if t == high)
    n = min(tops[r] for r in behind) + 1
    e = by_rank[ahead].get(n) or by_rank[ahead][high]
    cause = (f"rank{'s' if len(behind) > 1 else ''} {', '.join(map(str, behind))} never issued collective #{n} of "
             f"{_gname(name, desc)}: {_op(e)} at {_site(e)}, which rank {ahead} issued and waits in")
    evidence = [f"rank {r}: issued up to #{t} of {_gname(name, desc)}; last entry {_describe(last.get(r))}"
                for r, t in sorted(tops.items())]
    return Finding(cause, evidence)


def _p2p(g: tuple, pairs: dict[tuple[int, int], dict[str, list]], last: dict) -> Finding | None:
    name, desc, _ = g
    for (src, dst), ops in sorted(pairs.items()):
        sends, recvs = ops["send"], ops["recv"]
        for k, (s, r) in enumerate(zip(sends, recvs)):
            if s.get("input_sizes") != r.get("output_sizes") or s.get("input_dtypes") != r.get("output_dtypes"):
                return Finding(  # each side's own p2p sequence number in the group: what its dump lists
                    f"point-to-point shape mismatch in {_gname(name, desc)}: send #{k + 1} from rank {src} to rank "
                    f"{dst} carries {s.get('input_sizes')} {s.get('input_dtypes')} (rank {src}'s p2p "
                    f"#{s.get('p2p_seq_id')}, at {_site(s)}), rank {dst} receives {r.get('output_sizes')} "
                    f"{r.get('output_dtypes')} (rank {dst}'s p2p #{r.get('p2p_seq_id')}, at {_site(r)})",
                    [f"rank {src}: {_describe(s)}", f"rank {dst}: {_describe(r)}"]
                    + [f"rank {x}: last entry {_describe(last.get(x))}" for x in (src, dst)])
        if len(sends) != len(recvs):
            more, kind, who, other = (sends, "send", src, dst) if len(sends) > len(recvs) else (recvs, "recv", dst, src)
            e = more[min(len(sends), len(recvs))]
            verb = f"send to rank {dst} with no matching recv on rank {dst}" if kind == "send" else \
                f"recv from rank {src} with no matching send on rank {src}"
            return Finding(
                f"point-to-point: rank {who} issued a {verb}: {_op(e)} {e.get('input_sizes')} "
                f"{e.get('input_dtypes')} (p2p #{e.get('p2p_seq_id')} of {_gname(name, desc)}) at {_site(e)}, "
                f"{e.get('state')}",
                [f"rank {src} sent {len(sends)}, rank {dst} received {len(recvs)} in {_gname(name, desc)}"]
                + [f"rank {x}: last entry {_describe(last.get(x))}" for x in (who, other)])
    return None


def _straggler(g: tuple, by_rank: dict[int, dict[int, dict]]) -> Finding | None:
    name, desc, _ = g
    if len(by_rank) < 2:
        return None
    worst: tuple[float, int, int] | None = None
    for seq in set.intersection(*(set(s) for s in by_rank.values())):
        times = {r: by_rank[r][seq].get("time_created_ns") for r in by_rank}
        if any(not isinstance(t, int) for t in times.values()):
            continue
        late = max(times, key=times.__getitem__)
        gap = (times[late] - max(t for r, t in times.items() if r != late)) / 1e9
        if worst is None or gap > worst[0]:
            worst = (gap, late, seq)
    if worst is None or worst[0] < STRAGGLER_S:
        return None
    gap, late, seq = worst
    e = by_rank[late][seq]
    return Finding(f"straggler: rank {late} entered collective #{seq} of {_gname(name, desc)} ({_op(e)} at {_site(e)}) "
                   f"{gap:.1f} s after the other ranks", [f"rank {r}: #{seq} entered at "
                                                         f"{by_rank[r][seq]['time_created_ns'] / 1e9:.3f}"
                                                         for r in sorted(by_rank)])


# ---------------------------------------------------------------------- the command
def answer(folder: str) -> tuple[int, list[str]]:
    """(exit status, lines): the cause first, then the evidence."""
    try:
        dumps = load(folder)
    except (Unreadable, OSError) as exc:
        return 2, [f"portspeed why-hung: error: {exc}"]
    f = analyse(dumps)
    reasons = ", ".join(f"rank {r}: {d['reason']}" for r, d in sorted(dumps.items()))
    return (0 if f.found else 1), [f.cause, *[f"  {x}" for x in f.evidence], f"  dumps: {reasons}"]


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``portspeed why-hung DIR``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: portspeed why-hung DIR  (the folder the ranks' flight-recorder dumps are in)",
              file=sys.stderr)
        return 0 if argv in (["-h"], ["--help"]) else 2
    code, lines = answer(argv[0])
    print("\n".join(lines), file=sys.stderr if code == 2 else sys.stdout)
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
