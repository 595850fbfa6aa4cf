"""`portspeed patches`: every patch of ``portspeed.manager()``, its status, and why.

By default the adaptors are imported first (``--adaptor all``: the Megatron and the
DeepSpeed adaptor), so that their patch sets are registered and gated; importing an
adaptor never imports the framework, so framework patches show as ``pending`` until
their module is imported. ``--import-targets`` then imports each pending patch's module
(that does import Megatron / DeepSpeed), so the listing shows what is really applied
and which names were rebound where. ``--adaptor none`` lists the manager as it stands
(useful from inside a program, through ``main``).

Statuses: applied, pending (waiting for an import), skipped (target missing or version
out of range), failed, inactive (condition false on this adapter), disabled
(PORTSPEED_DISABLE), reverted. ``--deep`` adds references the manager could not rebind
(closures, defaults, containers: found through the garbage collector, slow).

``--check SOURCE`` instead checks the Megatron patches against a Megatron source without
importing it (``portspeed.patching.drift``): SOURCE is a Megatron-LM checkout, a megatron-core
wheel, ``GITDIR@TAG``, ``installed``, or a release number (its cp312 wheel is downloaded
with pip). ``--record`` then writes the fingerprints it found for that release into
``portspeed/patches/megatron/fingerprints.py`` (after reviewing the changed patches).

Exit status: 0, or 1 when an adaptor or a target import failed or any patch failed (with
``--check``: when any patch's target is missing or changed, or was never recorded); 2 when
the source cannot be read.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any

from portspeed.integrations import patch_sets

__all__ = ["ADAPTORS", "STATUS_ORDER", "collect", "main", "render"]

#: --adaptor choices -> adaptor modules imported.
ADAPTORS: dict[str, tuple[str, ...]] = {
    **{name: (module,) for name, module in patch_sets.ADAPTORS.items()},
    "all": tuple(patch_sets.ADAPTORS.values()),
    "none": (),
}

#: The order statuses are listed in.
STATUS_ORDER = ("failed", "skipped", "applied", "pending", "inactive", "disabled", "reverted", "registered")


def _import_all(modules: list[str]) -> dict[str, str]:
    """Import each module; {module: 'ok', 'absent: ...' (not installed) or the error}."""
    out: dict[str, str] = {}
    for mod in modules:
        try:
            importlib.import_module(mod)
            out[mod] = "ok"
        except ModuleNotFoundError as exc:
            missing = exc.name or ""
            if missing and (mod == missing or mod.startswith(missing + ".")):
                # the module (or its package) is not installed: its patches just stay pending
                out[mod] = f"absent: {missing!r} is not installed"
            else:
                out[mod] = f"ModuleNotFoundError: {exc}"
        except Exception as exc:  # reported, and the exit status says so
            out[mod] = f"{type(exc).__name__}: {exc}"
    return out


def _failed(state: str) -> bool:
    return state != "ok" and not state.startswith("absent:")


def collect(adaptor: str = "all", import_targets: bool = False, deep: bool = False) -> dict[str, Any]:
    """Import the requested adaptors (and targets), then the manager's report as plain data."""
    if adaptor not in ADAPTORS:
        raise ValueError(f"unknown adaptor {adaptor!r}; choose one of {', '.join(ADAPTORS)}")
    import portspeed

    result: dict[str, Any] = {"adaptors": _import_all(list(ADAPTORS[adaptor]))}
    if import_targets:
        from portspeed.integrations import activation

        activation.activate_waiting()  # the adaptors defer their set-up to the framework's first import
        pending = [r.patch.module for r in portspeed.manager().records() if r.status == "pending"]
        result["target_imports"] = _import_all(list(dict.fromkeys(pending)))
    patches = portspeed.report(deep=deep)
    counts: dict[str, int] = {}
    for p in patches:
        counts[p["status"]] = counts.get(p["status"], 0) + 1
    result["counts"] = counts
    result["patches"] = patches
    errors = [v for v in result["adaptors"].values() if v != "ok"]
    errors += [v for v in result.get("target_imports", {}).values() if _failed(v)]
    result["ok"] = not errors and not counts.get("failed")
    return result


def render(result: dict[str, Any]) -> str:
    """The human-readable listing, grouped by status."""
    out: list[str] = []
    for mod, state in result["adaptors"].items():
        out.append(f"adaptor {mod}: {'imported' if state == 'ok' else 'IMPORT FAILED: ' + state}")
    for mod, state in result.get("target_imports", {}).items():
        if state != "ok":
            out.append(f"import {mod}: {'FAILED: ' + state if _failed(state) else state}")
    patches = result["patches"]
    summary = ", ".join(f"{result['counts'][s]} {s}" for s in STATUS_ORDER if s in result["counts"])
    total = sum(result["counts"].values())
    shown = f"; showing the {len(patches)} with status {', '.join(result['filter'])}" if "filter" in result else ""
    out.append(f"{total} patches" + (f": {summary}" if summary else "") + shown)
    if not patches:
        out.append("  (none registered: import portspeed.megatron_adaptor or portspeed.deepspeed_adaptor, "
                   "or run without --adaptor none)")
    rank = {s: i for i, s in enumerate(STATUS_ORDER)}
    for p in sorted(patches, key=lambda p: rank.get(p["status"], len(rank))):
        gate = f"  [{p['distribution']} {p['versions']}]" if p.get("distribution") else ""
        out.append("")
        out.append(f"{p['status'].upper():9} {p['name']}  ({p['kind']} {p['target']}){gate}")
        out.append(f"          why: {p['reason']}")
        if p.get("detail"):
            out.append(f"          detail: {p['detail']}")
        if p.get("chain"):
            out.append(f"          chain: {' -> '.join(p['chain'])}")
        if p.get("rebound"):
            out.append(f"          rebound in: {', '.join(p['rebound'])}")
        if "unrebindable" in p:
            refs = p["unrebindable"]
            out.append(f"          not rebindable: {', '.join(refs) if refs else 'none found'}")
    return "\n".join(out) + "\n"


def check_source(spec: str) -> dict[str, Any]:
    """The drift check of the Megatron patch set against ``spec`` (see ``portspeed.patching.drift``), as plain data."""
    from portspeed.patching import drift

    tree = drift.open_source(spec)
    patches = patch_sets.load("megatron")
    release, findings = drift.check(patches, tree)
    counts: dict[str, int] = {}
    for f in findings:
        counts[f.status] = counts.get(f.status, 0) + 1
    # the sources that show where a narrowed range's upstream edge is (portspeed.patching.narrowing)
    watches = sorted({w for p in patches for w in getattr(p.versions, "watch", ())})
    return {"source": tree.label, "release": str(release), "counts": counts,
            "findings": [f.as_dict() for f in findings], "ok": not any(counts.get(s) for s in drift.DRIFT),
            "watched": drift.scan_watched(tree, watches)}


def render_check(result: dict[str, Any]) -> str:
    """One line per patch: status, name, and what changed."""
    summary = ", ".join(f"{n} {s}" for s, n in sorted(result["counts"].items()))
    out = [f"megatron-core {result['release']} from {result['source']}: {summary}"]
    order = {s: i for i, s in enumerate(("missing", "changed", "unrecorded", "ok", "inactive", "absent"))}
    for f in sorted(result["findings"], key=lambda f: (order.get(f["status"], 9), f["name"])):
        out.append(f"  {f['status'].upper():10} {f['name']}  ({f['target']}): {f['detail']}")
    return "\n".join(out) + "\n"


def record(result: dict[str, Any], path: str | None = None) -> str:
    """Merge ``result``'s fingerprints (release -> digest per patch) into the fingerprints module; returns its path."""
    fingerprints = patch_sets.megatron_fingerprints()
    table = {k: dict(v) for k, v in fingerprints.FINGERPRINTS.items()}
    for f in result["findings"]:
        if f["fingerprint"] is not None and f["status"] != "inactive":
            table.setdefault(f["name"], {})[result["release"]] = f["fingerprint"]
    watched = {k: dict(v) for k, v in getattr(fingerprints, "WATCHED", {}).items()}
    for watch, digest in result.get("watched", {}).items():
        watched.setdefault(watch, {})[result["release"]] = digest
    path = path or fingerprints.__file__
    head = (fingerprints.__doc__ or "").strip()
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(f'"""{head}\n"""\n\n{_table("FINGERPRINTS: dict[str, dict[str, str]]", table)}\n\n'
                 f'#: "module:attr" -> release -> fingerprint (None: not there) of the sources narrowed ranges watch\n'
                 f'{_table("WATCHED: dict[str, dict[str, str | None]]", watched)}\n')
    return path


def _table(declaration: str, table: dict[str, dict[str, str | None]]) -> str:
    """``declaration = {...}`` as Python source: a name per line, then its releases, one a line (sorted)."""
    lines = [f"{declaration} = {{"]
    for name in sorted(table):
        lines.append(f"    {name!r}: {{")
        lines += [f"        {release!r}: {digest!r}," for release, digest in sorted(table[name].items())]
        lines.append("    },")
    return "\n".join(lines + ["}"])


def main(argv: list[str] | None = None) -> int:
    """`portspeed patches`.

    Usage: portspeed patches [--json] [--deep] [--adaptor A] [--import-targets] [--status S ...]
                             [--check SRC [--record]]
    """
    parser = argparse.ArgumentParser(prog="portspeed patches", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the listing")
    parser.add_argument("--deep", action="store_true",
                        help="also list references that could not be rebound (walks the garbage collector; slow)")
    parser.add_argument("--adaptor", choices=list(ADAPTORS), default="all",
                        help="framework set-ups (adaptors) to import before listing (default: all; none: list the "
                        "manager as is)")
    parser.add_argument("--import-targets", action="store_true",
                        help="import the module of every pending patch first (imports the frameworks)")
    parser.add_argument("--status", nargs="+", choices=STATUS_ORDER, metavar="STATUS",
                        help=f"only list patches in these statuses ({', '.join(STATUS_ORDER)})")
    parser.add_argument("--check", metavar="PATH_OR_VERSION",
                        help="check the Megatron patches' targets against a checkout, wheel, GITDIR@TAG, "
                             "'installed' or a megatron-core release, without importing it")
    parser.add_argument("--record", action="store_true",
                        help="with --check: record this release's fingerprints (after reviewing the changes)")
    args = parser.parse_args(argv)
    if args.record and not args.check:
        parser.error("--record needs --check SOURCE")
    if args.check:
        from portspeed.patching.drift import SourceError

        try:
            checked = check_source(args.check)
        except SourceError as exc:
            sys.stderr.write(f"portspeed patches --check: {exc}\n")
            return 2
        if args.record:
            sys.stderr.write(f"recorded megatron-core {checked['release']} in {record(checked)}\n")
        sys.stdout.write(json.dumps(checked, indent=2) + "\n" if args.json else render_check(checked))
        return 0 if checked["ok"] or args.record else 1
    result = collect(args.adaptor, import_targets=args.import_targets, deep=args.deep)
    if args.status:
        result["filter"] = list(args.status)
        result["patches"] = [p for p in result["patches"] if p["status"] in args.status]
    if args.json:
        sys.stdout.write(json.dumps(result, indent=2, default=str) + "\n")
    else:
        sys.stdout.write(render(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
