"""How long PatchManager.apply takes with many modules loaded and many patches: goal <= 50 ms at 2,000/200.

Writes synthetic modules to a temporary directory (each: ten functions, a class with
three methods and a class attribute alias, an alias of the previous module's function,
so the rebinding sweep has real work), imports them, then times ``apply()`` of P
patches on a fresh manager (and the ``revert()`` that follows) for a grid of module and
patch counts. Modules are imported in rising counts in this one process; the modules
``import portspeed`` brings (torch) are loaded too and counted in "loaded".

    OMP_NUM_THREADS=1 python benchmarks/bench_apply.py
    OMP_NUM_THREADS=1 python benchmarks/bench_apply.py --modules 1000 2000 4000 --patches 50 100 200 400
"""

from __future__ import annotations

import argparse
import gc
import importlib
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from portspeed.patching.manager import PatchManager
from portspeed.patching.record import Patch

PKG = "bench_apply_synth"


def _write_modules(root: Path, n: int) -> None:
    pkg = root / PKG
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for i in range(n):
        prev = f"from {PKG}.m{i - 1} import f0 as prev_f0\n" if i else ""
        funcs = "".join(f"def f{k}(x):\n    return x + {k}\n\n" for k in range(10))
        (pkg / f"m{i}.py").write_text(f"import os\n{prev}CONST = {i}\n\n" + funcs + textwrap.dedent(f"""\
            class K{i}:
                h = f0
                def a(self):
                    return 1
                def b(self):
                    return 2
                @classmethod
                def c(cls):
                    return 3
            """))


def _wrapper(wrapped, instance, args, kwargs):  # type: ignore[no-untyped-def]
    return wrapped(*args, **kwargs)


def _patches(n_patches: int, spread: int) -> list[Patch]:
    """Distinct targets in the first ``spread`` modules: function wraps, method wraps, function replacements."""
    out: list[Patch] = []
    for p in range(n_patches):
        i, k = p % spread, (p // spread) % 10
        if p % 3 == 0:
            out.append(Patch(name=f"w{p}", target=f"{PKG}.m{i}:f{k}", kind="wrap", impl=_wrapper, reason="bench"))
        elif p % 3 == 1:
            out.append(Patch(name=f"m{p}", target=f"{PKG}.m{i}:K{i}.{'abc'[k % 3]}", kind="wrap",
                             impl=_wrapper, reason="bench"))
        else:
            out.append(Patch(name=f"r{p}", target=f"{PKG}.m{i}:f{k}", kind="replace",
                             impl=lambda x: x, reason="bench"))
    return out


def _time(n_patches: int, spread: int, repeats: int) -> tuple[float, float]:
    """Median (apply ms, revert ms), CPU time of this process."""
    applies, reverts = [], []
    patches = _patches(n_patches, spread)
    for _ in range(repeats):
        mgr = PatchManager()
        mgr.register(patches)
        gc.collect()
        t0 = time.process_time()
        mgr.apply()
        applies.append((time.process_time() - t0) * 1e3)
        assert all(r.status == "applied" for r in mgr.records()), "bench patches must all apply"
        t1 = time.process_time()
        mgr.revert()
        reverts.append((time.process_time() - t1) * 1e3)
        assert all(r.status == "reverted" for r in mgr.records()), "bench patches must all revert"
    return statistics.median(applies), statistics.median(reverts)


def main(argv: list[str] | None = None) -> int:
    """Print apply/revert times over the module and patch grid, with per-unit costs to show linearity."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modules", type=int, nargs="+", default=[250, 1000, 2000, 4000],
                    help="synthetic module counts; patches target the first (smallest) count "
                         "(default 250 1000 2000 4000)")
    ap.add_argument("--patches", type=int, nargs="+", default=[50, 100, 200, 400],
                    help="patch counts timed at the --at module count (default 50 100 200 400)")
    ap.add_argument("--at", type=int, default=2000, help="module count for the patch sweep (default 2000)")
    ap.add_argument("--fixed-patches", type=int, default=200, help="patches for the module sweep (default 200)")
    ap.add_argument("--repeats", type=int, default=5, help="runs per point; the median is printed (default 5)")
    args = ap.parse_args(argv)
    counts = sorted(set(args.modules) | {args.at})
    spread = counts[0]  # every timed point patches the same first modules, so only the load varies
    if counts[0] < 1 or min(args.patches) < 1 or args.repeats < 1:
        ap.error("module counts, patch counts and --repeats must be >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        _write_modules(Path(tmp), counts[-1])
        sys.path.insert(0, tmp)
        importlib.invalidate_caches()
        loaded = 0
        rows = []
        for n in counts:
            for i in range(loaded, n):
                importlib.import_module(f"{PKG}.m{i}")
            loaded = n
            if n in args.modules:
                a, r = _time(args.fixed_patches, spread, args.repeats)
                rows.append(("modules", n, len(sys.modules), args.fixed_patches, a, r))
            if n == args.at:
                for p in sorted(args.patches):
                    a, r = _time(p, spread, args.repeats)
                    rows.append(("patches", n, len(sys.modules), p, a, r))
    print(f"CPU ms, median of {args.repeats}; python {sys.version.split()[0]}; "
          "'loaded' counts every module in sys.modules (torch's included)")
    print(f"{'sweep':8} {'synthetic':>9} {'loaded':>7} {'patches':>7} {'apply ms':>9} {'revert ms':>9}  "
          "slope from previous row")
    prev: tuple | None = None
    for row in sorted(rows, key=lambda r: (r[0] != "modules", r[1], r[3])):
        kind, n, loaded_total, p, a, r = row
        slope = ""
        if prev is not None and prev[0] == kind:
            if kind == "modules":
                slope = f"{(a - prev[4]) / (loaded_total - prev[2]) * 1000:+.2f} ms per 1,000 modules"
            else:
                slope = f"{(a - prev[4]) / (p - prev[3]) * 1000:+.1f} us per patch"
        print(f"{kind:8} {n:9d} {loaded_total:7d} {p:7d} {a:9.1f} {r:9.1f}  {slope}")
        prev = row
    return 0


if __name__ == "__main__":
    sys.exit(main())
