"""`portspeed info`: what this machine would run, before anything is run.

Reports, like DeepSpeed's ``ds_report``:
- versions of torch, megatron-core, deepspeed and portspeed's own dependencies (from
  distribution metadata: nothing is imported to read a version);
- every adapter (built-in and entry-point): vendor package installed, device available,
  and which one is selected and why (``selection_reason()``). Answered from what is
  installed, built and declared in Python: no device runtime is imported or compiled here
  (an adapter's vendor modules already imported, e.g. by auto-detection, are asked whether a
  device is there; otherwise the row says "not loaded"; an adapter that declares
  ``vendor_build_missing()``, the test device, says "not built: ..." when its build is absent);
- the selected backend's capability gaps on the installed torch (what the collective
  router will rewrite);
- each patch set (torch_cuda, torch_distributed, megatron, deepspeed) with every patch's
  gate evaluated by the manager's own ``gate()`` (``portspeed.patching.gate``), in its words:
  pending (applies once its module is imported), skipped (distribution missing), disabled by
  PORTSPEED_DISABLE, inactive (its range excludes this release, or not for this adapter), or
  failed (its condition raised).
  Versions are those gates read (``versions.gate_version``: a Megatron-LM checkout on
  PYTHONPATH counts, not the wheel it shadows). Gates are read from the Patch records
  and distribution metadata; Megatron and DeepSpeed are not imported.

``--json`` prints the same as one JSON object. ``--adapter NAME`` reports as if
``PORTSPEED_ACCELERATOR=NAME`` were set: an adapter name, ``module:Class`` or
``path/to/file.py:Class`` (an adapter that is not installed; its row joins the table). Exit status:
0, 1 when the settings are invalid or no adapter can be selected (the report says why), 2 when
``--adapter`` names no adapter (one line saying what is missing).
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
from typing import Any, Callable

from portspeed import __version__, config
from portspeed.accelerator import adapter_class, available_adapters, get_accelerator, registry, selection_reason
from portspeed.errors import PortspeedError
from portspeed.integrations import patch_sets
from portspeed.patching.gate import VersionCache, gate
from portspeed.versions import SUPPORTED, distribution_version, gate_version

__all__ = ["PATCH_SETS", "VERSIONED", "collect", "evaluate_gate", "main"]

#: Distributions whose versions are reported.
VERSIONED = ("torch", "megatron-core", "deepspeed", "wrapt", "packaging", "importlib-metadata", "numpy")

#: Patch sets: name -> (module, attribute), named once in the integrations layer.
PATCH_SETS = patch_sets.PATCH_SETS

_FRAMEWORKS = ("megatron", "deepspeed")


def _version(name: str) -> str:
    v = distribution_version(name)
    return str(v) if v is not None else "not installed"


def _gate_versions() -> dict[str, str]:
    """What gates compare against where it is not the metadata (a checkout on PYTHONPATH), and untested releases."""
    from packaging.specifiers import SpecifierSet

    out: dict[str, str] = {}
    for name, supported in SUPPORTED.items():
        gv = gate_version(name)
        if gv.version is None:
            continue
        line = gv.describe(name) if gv.source != "metadata" else ""
        if gv.version not in SpecifierSet(supported, prereleases=True):
            line = f"{gv.describe(name)}: UNTESTED, outside the supported {supported}"
        if line:
            out[name] = line
    return out


def _build_missing(cls: Any) -> str | None:
    """What the adapter declares must be built before its runtime loads ("not built: ..."), or None."""
    ask = getattr(cls, "vendor_build_missing", None)
    if not callable(ask):
        return None
    try:
        return ask()
    except Exception as exc:  # a broken declaration is reported, not fatal
        return f"build state unknown: {type(exc).__name__}: {exc}"


def _vendor_state(cls: Any) -> tuple[bool, bool | None, str]:
    """(installed, available, note) from what is installed, built and already imported; imports no vendor module.

    ``available`` is None where the answer needs the vendor runtime loaded (importing it can
    register a device or compile an extension, which `portspeed info` never does).
    """
    if not cls.vendor_installed():
        return False, False, ""
    missing = _build_missing(cls)
    if missing:
        return False, False, missing
    if any(m not in sys.modules for m in cls.vendor_modules):
        return True, None, "not loaded (portspeed info imports no device runtime)"
    try:
        return True, bool(cls.detect()), ""
    except Exception as exc:
        return True, False, f"detection failed: {type(exc).__name__}: {exc}"


def _adapters(selected: str | None, spec: str | None = None) -> list[dict[str, Any]]:
    """One row per known adapter, and one for ``spec`` (``module:Class`` / ``file.py:Class``) when it is selected."""
    rows = []
    for name in available_adapters() + ([spec] if spec else []):
        row: dict[str, Any] = {"name": name, "selected": name == selected if name != spec else True}
        try:
            cls = adapter_class(name)
        except Exception as exc:  # a broken entry point is reported, not fatal
            row.update(error=f"{type(exc).__name__}: {exc}")
            rows.append(row)
            continue
        installed, available, note = _vendor_state(cls)
        row.update(
            vendor_package=cls.vendor_package,
            package_installed=installed,
            available=available,
            backend=cls.backend,
            verified_on_hardware=cls.verified_on_hardware,
        )
        if note:
            row["note"] = note
        rows.append(row)
    return rows


def _capabilities(acc: Any) -> dict[str, Any]:
    """The backend's gaps, read defensively: capabilities.py is still growing."""
    out: dict[str, Any] = {"backend": acc.communication_backend}
    try:
        caps = acc.capabilities()
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        return out
    describe = getattr(caps, "describe", None)
    gaps = describe() if callable(describe) else [{"collective": c} for c in sorted(getattr(caps, "missing", ()))]
    out["torch_version"] = getattr(caps, "torch_version", "")
    out["gaps"] = list(gaps)
    out["notes"] = list(getattr(caps, "notes", ()))
    return out


def evaluate_gate(patch: Any, settings: config.Settings, acc: Any, versions: Any = None) -> tuple[str, str]:
    """(status, why) for one Patch without importing its target: the manager's own ``gate()``, same words."""
    return gate(patch, settings, lambda: acc, versions)


def _patch_sets(settings: config.Settings, acc: Any) -> list[dict[str, Any]]:
    out = []
    for set_name, (module, attr) in PATCH_SETS.items():
        versions = VersionCache()
        entry: dict[str, Any] = {"name": set_name, "source": f"{module}:{attr}"}
        before = {f for f in _FRAMEWORKS if f in sys.modules}
        try:
            patches = patch_sets.load(set_name)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                entry["error"] = f"ModuleNotFoundError: {exc}"
            else:
                entry["error"] = "not present in this portspeed"
            out.append(entry)
            continue
        except Exception as exc:
            entry["error"] = f"could not load: {type(exc).__name__}: {exc}"
            out.append(entry)
            continue
        imported = sorted({f for f in _FRAMEWORKS if f in sys.modules} - before)
        if imported:
            entry["warning"] = (f"loading this patch set imported {', '.join(imported)} "
                                "(a patch module imports it at top level)")
        rows = []
        for p in patches:
            state, why = evaluate_gate(p, settings, acc, versions)
            rows.append({"name": p.name, "target": p.target, "kind": p.kind, "distribution": p.distribution,
                         "versions": p.versions, "state": state, "detail": why})
        entry["patches"] = rows
        counts: dict[str, int] = {}
        for r in rows:
            counts[r["state"]] = counts.get(r["state"], 0) + 1
        entry["counts"] = counts
        out.append(entry)
    return out


def _requested_unbuilt(settings: config.Settings) -> dict[str, Any] | None:
    """The named adapter (PORTSPEED_ACCELERATOR) when selecting it would compile its runtime first, else None."""
    name = settings.accelerator
    if not name:
        return None
    try:
        missing = _build_missing(adapter_class(name))
    except Exception:  # an unknown name: selection reports it
        return None
    if not missing:
        return None
    return {"name": name, "reason": "PORTSPEED_ACCELERATOR",
            "not_loaded": f"{missing}; portspeed info builds nothing (a run builds it on first use)"}


def collect() -> dict[str, Any]:
    """Everything `portspeed info` reports, as plain data."""
    report: dict[str, Any] = {
        "portspeed": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": {name: _version(name) for name in VERSIONED},
        "gate_versions": _gate_versions(),
        "ok": True,
    }
    try:
        settings = config.settings()
    except PortspeedError as exc:
        report.update(ok=False, settings_error=str(exc))
        settings = config.Settings()
    acc = None
    unbuilt = _requested_unbuilt(settings) if report["ok"] else None
    if unbuilt is not None:
        report["selected"] = unbuilt
    elif report["ok"]:
        try:
            acc = get_accelerator()
            report["selected"] = {**acc.describe(), "reason": selection_reason()}
        except PortspeedError as exc:
            report.update(ok=False, selected={"error": f"{type(exc).__name__}: {exc}"})
    spec = settings.accelerator if settings.accelerator and registry.is_spec(settings.accelerator) else None
    report["adapters"] = _adapters(None if spec else acc.name if acc is not None else (unbuilt or {}).get("name"), spec)
    if acc is not None:
        report["capabilities"] = _capabilities(acc)
    report["patch_sets"] = _patch_sets(settings, acc)
    report["transformer_engine"] = _transformer_engine(report["patch_sets"])
    if acc is not None:
        report["te_kernels"] = te_kernels(spec or acc.name, settings)
    return report


def te_kernels(adapter: str, settings: config.Settings) -> list[dict[str, str]]:
    """Which implementation serves each portable-TE operation on ``adapter`` (a name or ``module:Class`` /
    ``file.py:Class``), and why: from the adapter's Python
    declarations and this torch only (``portable_te.kernels.plan``: nothing imported, no device runtime)."""
    from portspeed.portable_te.kernels import plan

    try:
        return [c._asdict() for c in plan(adapter_class(adapter), settings)]
    except Exception as exc:  # a broken declaration is refused at activation; here it is reported
        return [{"op": "*", "impl": "error", "why": f"{type(exc).__name__}: {exc}"}]


#: the patch that serves portspeed's portable Transformer Engine (patches/megatron/core_portable_te.py)
PORTABLE_TE_PATCH = "megatron.core.transformer_engine.portable"


def _transformer_engine(sets: list[dict[str, Any]]) -> str:
    """Which Transformer Engine Megatron's TE path gets here, in one line."""
    from portspeed.portable_te import serve

    nvidia = serve.nvidia_installed()
    if nvidia is not None:
        return f"NVIDIA transformer_engine {nvidia} (installed; portspeed's portable one stays off)"
    state = next((r for s in sets for r in s.get("patches", []) if r["name"] == PORTABLE_TE_PATCH), None)
    if state is None:
        return "none (the Megatron patch set is not loaded)"
    if state["state"] in ("applied", "pending"):
        return serve.describe()
    return f"none: the portable Transformer Engine is {state['state']} ({state['detail']})"


# ----------------------------------------------------------------------------- text output
def _yn(v: Any) -> str:
    return "yes" if v else "no"


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def render(report: dict[str, Any]) -> str:
    """The human-readable report."""
    out = [f"portspeed {report['portspeed']}  (python {report['python']}, {report['platform']})", "", "versions:"]
    out += _table([[k, v] for k, v in report["versions"].items()])
    for name, line in report.get("gate_versions", {}).items():
        out.append(f"  gates read: {line}")
    if "transformer_engine" in report:
        out.append(f"  transformer engine: {report['transformer_engine']}")
    if "settings_error" in report:
        out += ["", f"SETTINGS ERROR: {report['settings_error']}"]
    out += ["", "adapters:"]
    rows = [["name", "package", "installed", "available", "backend", "verified", "selected", "note"]]
    for a in report["adapters"]:
        if "error" in a:  # the error goes under the table: in a cell it would widen every row to its length
            rows.append([a["name"], "-", "-", "-", "-", "-", "", "refused (below)"])
            continue
        sel = report.get("selected", {})
        rows.append([
            a["name"], a["vendor_package"] or "-", _yn(a["package_installed"]),
            "?" if a["available"] is None else _yn(a["available"]), a["backend"], _yn(a["verified_on_hardware"]),
            f"* {sel.get('reason', '')}" if a["selected"] else "", a.get("note", ""),
        ])
    out += _table(rows)
    sel = report.get("selected")
    said = sel.get("error") if sel else None
    out += [f"  {a['name']}: ERROR {a['error']}" for a in report["adapters"]
            if "error" in a and a["error"] != said]  # the selection's own error is said once, below
    if sel and "error" in sel:
        out += ["", f"SELECTION ERROR: {sel['error']}"]
    if sel and "not_loaded" in sel:
        out += ["", f"selected {sel['name']!r} ({sel['reason']}), not loaded: {sel['not_loaded']}"]
    caps = report.get("capabilities")
    if caps:
        out += ["", f"backend {caps['backend']!r} on torch {caps.get('torch_version', '?')}:"]
        if "error" in caps:
            out.append(f"  capabilities unavailable: {caps['error']}")
        elif not caps.get("gaps"):
            out.append("  no known capability gaps")
        else:
            out.append("  capability gaps (the collective router rewrites these):")
            out += _table([[g.get("collective", ""), g.get("op", "any"), g.get("dtype", "any"),
                            g.get("effect", ""), g.get("note", "")] for g in caps["gaps"]], indent="    ")
        for n in caps.get("notes", []):
            out.append(f"  note: {n}")
    if report.get("te_kernels"):
        out += ["", "portable Transformer Engine kernels (vendor -> torch -> reference; PORTSPEED_TE_KERNELS):"]
        out += _table([[k["op"], k["impl"], k["why"]] for k in report["te_kernels"]])
    out += ["", "patch sets:"]
    for s in report["patch_sets"]:
        if "error" in s:
            out.append(f"  {s['name']}: {s['error']}")
            continue
        counts = ", ".join(f"{n} {k}" for k, n in sorted(s["counts"].items())) or "empty"
        out.append(f"  {s['name']} ({len(s['patches'])} patches: {counts})")
        if "warning" in s:
            out.append(f"    WARNING: {s['warning']}")
        if s["patches"]:
            out += _table([[p["name"], p["state"], p["detail"]] for p in s["patches"]], indent="    ")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    """`portspeed info [--json]`."""
    parser = argparse.ArgumentParser(prog="portspeed info", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the text report")
    parser.add_argument("--adapter", default=None, metavar="NAME",
                        help="device adapter to report as if PORTSPEED_ACCELERATOR=NAME: an adapter name, "
                        "module:Class or path/to/file.py:Class")
    args = parser.parse_args(argv)
    if args.adapter is not None:
        import dataclasses

        from portspeed.accelerator import preflight

        try:  # the check and resolution PORTSPEED_ACCELERATOR gets (a relative file made absolute)
            adapter = preflight.check_adapter_spec(args.adapter, "--adapter ")
        except PortspeedError as exc:
            print(f"portspeed info: error: {exc}", file=sys.stderr)
            return 2
        try:  # this process's settings, the environment left as it is
            config.use(dataclasses.replace(config.reload(), accelerator=adapter))
        except PortspeedError:
            pass  # another setting is refused: collect() reports it
    report = collect()
    writer: Callable[[str], Any] = sys.stdout.write
    writer(json.dumps(report, indent=2, default=str) + "\n" if args.json else render(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
