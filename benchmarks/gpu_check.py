"""The Python parts of benchmarks/gpu_check.sh: preflight, the example GPT with and without portspeed, the TE step.

Why one helper: the shell script bounds each part with ``timeout`` and must go on after a failure,
so every part is a separate command that writes ``<out>/<part>.json``; ``table`` reads whatever is
there and says, for each part, what it measured or why it has no result. ``--device cpu`` runs
the same code tiny on the host (the dry run, and CI). Subcommands:

- ``preflight``: torch, the device, megatron-core, where portspeed's packages are imported from;
  with ``--device cuda`` and no GPU it stops, saying so.
- ``example``: examples/pretrain_gpt.py on one rank, with portspeed as it runs and with every
  portspeed patch blocked (``PORTSPEED_DISABLE='*'``: on CUDA nothing is translated either, so that
  is the run without portspeed); runs alternate, the median step times and their ratio (goal <= 1.005).
- ``te``: the example GPT's training step with Megatron's TE layer spec on the portable Transformer
  Engine (torch kernels), the same with ``PORTSPEED_TE_KERNELS=reference``, and Megatron's local spec:
  median step time, peak memory, and which SDPA ops ran (profiler op names; none = the reference's
  matmul-softmax-matmul). ``te-step`` is one such run, in its own process.
- ``table``: the one table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpu_check_te import sdpa_ops, serve_portable_te

REPO = Path(__file__).resolve().parents[1]
RESULT = "GPU_CHECK_RESULT "
STEP = "step time ms: "
PARTS = ("preflight", "conformance", "example", "te", "attention")
#: sizes per device: the GPU's fill it a little, the CPU's are the dry run's (seconds)
SIZES = {
    "cuda": {"example": ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16",
                         "--seq-length", "1024", "--vocab-size", "32000", "--micro-batch-size", "4",
                         "--global-batch-size", "4"], "example_iters": 40, "example_runs": 2,
             "te": ["--num-layers", "2", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length",
                    "4096", "--vocab-size", "32000", "--micro-batch-size", "2", "--global-batch-size", "2"],
             "te_iters": 15, "skip": 5},
    "cpu": {"example": ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length",
                        "32", "--vocab-size", "128", "--micro-batch-size", "2", "--global-batch-size", "2"],
            "example_iters": 4, "example_runs": 1,
            "te": ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
                   "--vocab-size", "128", "--micro-batch-size", "1", "--global-batch-size", "1"],
            "te_iters": 3, "skip": 1},
}
TE_VARIANTS = {  # name -> (layer spec, environment)
    "TE spec, torch kernels": ("te", {}),
    "TE spec, PORTSPEED_TE_KERNELS=reference": ("te", {"PORTSPEED_TE_KERNELS": "reference"}),
    "local spec": ("local", {}),
}
#: the portspeed patch that serves the portable TE off CUDA; te-step serves it itself (see serve_portable_te)
PORTABLE_PATCH = "megatron.core.transformer_engine.portable"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(make_cmd: Any, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """Run ``make_cmd()``; once more with a new command (a new free port) if the port was taken meanwhile.

    Why: a free port found here can be taken by another process before the child binds it (seen on a
    shared CI machine: EADDRINUSE); that is a race of the harness, not a result of the part.
    """
    out = subprocess.run(make_cmd(), env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0 and "EADDRINUSE" in out.stdout + out.stderr:
        out = subprocess.run(make_cmd(), env=env, capture_output=True, text=True, timeout=timeout)
    return out


def _write(out: Path, part: str, data: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{part}.json").write_text(json.dumps(data, indent=1))


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONWARNINGS": "ignore", **extra}


# --------------------------------------------------------------------------------------------- preflight
def preflight(args: argparse.Namespace) -> int:
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "cuda_build": torch.version.cuda,
                            "cuda_available": torch.cuda.is_available(), "device": args.device}
    if args.device == "cuda" and not torch.cuda.is_available():
        info["error"] = (f"CUDA is not available to torch {torch.__version__} (CUDA build {torch.version.cuda}); "
                         "run gpu_check.sh on a GPU machine, or `gpu_check.sh --dry-run` on the host")
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    try:
        import megatron.core

        from portspeed.versions import distribution_version

        info["megatron_core"] = str(distribution_version("megatron-core") or "unknown")
        info["megatron_from"] = str(Path(megatron.core.__file__).parents[1])
    except ImportError as exc:
        info["error"] = info.get("error") or (f"megatron-core does not import ({exc}); gpu_check.sh installs it from "
                                              ".whl/ (benchmarks/gpu_wheels.sh downloads it)")
    try:
        import portspeed
        import portspeed.adapters.cuda
        import portspeed.patches

        info["portspeed_from"] = str(Path(portspeed.__file__).parent)
        info["adapters_from"] = str(Path(portspeed.adapters.cuda.__file__).parent)
    except ImportError as exc:
        info["error"] = info.get("error") or f"portspeed does not import from the tree ({exc})"
    _write(args.out, "preflight", info)
    print(json.dumps(info, indent=1))
    if "error" in info:
        print(f"gpu_check: {info['error']}", file=sys.stderr)
        return 2
    return 0


# --------------------------------------------------------------------------------------------- (b) example
def _example_run(args: argparse.Namespace, disabled: bool) -> list[float]:
    sizes = SIZES[args.device]
    def cmd() -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
                "--master-port", str(_free_port()), str(REPO / "examples" / "pretrain_gpt.py"), *sizes["example"],
                "--iters", str(sizes["example_iters"]), "--print-step-time"]

    # CPU (the dry run) cannot run Megatron without portspeed's translation: there both runs have it
    env = _env(PORTSPEED_ACCELERATOR=args.device, **({"PORTSPEED_DISABLE": "*"} if disabled and args.device == "cuda"
                                                     else {}))
    out = _run(cmd, env, args.timeout)
    tag = "without" if disabled else "with"
    log = args.out / f"example_{tag}.log"
    with log.open("a") as fh:
        fh.write(out.stdout + out.stderr)
    if out.returncode != 0:
        raise RuntimeError(f"the example ({tag} portspeed) exited {out.returncode}; log {log}: "
                           f"{(out.stderr or out.stdout)[-600:]}")
    times = [float(line[len(STEP):]) for line in out.stdout.splitlines() if line.startswith(STEP)]
    return times[sizes["skip"]:]


def example(args: argparse.Namespace) -> int:
    """Alternate runs with and without portspeed; the ratio of the median step times."""
    times: dict[str, list[float]] = {"with": [], "without": []}
    try:
        for i in range(SIZES[args.device]["example_runs"]):
            for disabled in ((False, True) if i % 2 == 0 else (True, False)):
                times["without" if disabled else "with"] += _example_run(args, disabled)
                if times["with"] and times["without"]:  # after every pair: a part stopped by its timeout keeps it
                    _write(args.out, "example", _ratio(times))
    except Exception as exc:  # noqa: BLE001 - the part's result is the failure, said in the table
        _write(args.out, "example", {"error": f"{type(exc).__name__}: {exc}"})
        print(f"gpu_check example: {exc}", file=sys.stderr)
        return 1
    if not times["with"] or not times["without"]:
        _write(args.out, "example", {"error": "no 'step time ms' lines after the warm-up steps"})
        return 1
    print(json.dumps(_ratio(times)))
    return 0


def _ratio(times: dict[str, list[float]]) -> dict[str, Any]:
    w, wo = statistics.median(times["with"]), statistics.median(times["without"])
    return {"with_ms": w, "without_ms": wo, "ratio": w / wo, "steps": [len(times["with"]), len(times["without"])],
            "min_ratio": min(times["with"]) / min(times["without"])}


# --------------------------------------------------------------------------------------------- (c) TE step
def te_step(args: argparse.Namespace) -> int:
    """One variant, in this process: the example's training step on the TE or the local layer spec."""
    spec_kind = args.spec
    # what served_import reads: the TE path unless the command line says --transformer-impl local (as stock)
    sys.argv = [sys.argv[0]] + (["--transformer-impl", "local"] if spec_kind == "local" else [])
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(_free_port())}.items():
        os.environ.setdefault(k, v)
    import portspeed.megatron_adaptor  # noqa: F401  (first, as in the example)

    if spec_kind == "te":
        serve_portable_te()
    sys.path.insert(0, str(REPO / "examples"))
    import pretrain_gpt as pg
    import torch

    cuda = args.device == "cuda"
    sizes = SIZES[args.device]
    # the example's own flag picks Megatron's TE layer spec (served here by the portable TE)
    pargs = pg.parse_args(sizes["te"] + ["--transformer-impl", "transformer_engine" if spec_kind == "te" else "local"])
    model, optimizer, _, _ = pg.setup(pargs)
    used_te = any(c.__module__.startswith("portspeed.portable_te") for m in model[0].modules() for c in type(m).__mro__)
    if (spec_kind == "te") != used_te:
        raise SystemExit(f"the {spec_kind} spec built {'portable TE' if used_te else 'no portable TE'} modules")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = []
    for it in range(1, sizes["te_iters"] + 1):
        t0 = time.perf_counter()
        pg.train_step(pargs, model, optimizer, it)  # ends in .item(): the device is done
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    ops = sdpa_ops(lambda: pg.train_step(pargs, model, optimizer, sizes["te_iters"] + 1))
    res = {"spec": spec_kind, "kernels": os.environ.get("PORTSPEED_TE_KERNELS", "(default)"),
           "step_ms": statistics.median(times[sizes["skip"]:]) * 1e3, "peak_mb": (peak - base) / 2**20,
           "peak_what": "max_memory_allocated above the model and optimizer" if cuda else "maxrss above set-up",
           "sdpa_ops": ops, "portable_te": used_te}
    print(RESULT + json.dumps(res), flush=True)
    return 0


def te(args: argparse.Namespace) -> int:
    """The three variants, each in its own process (the kernel choice is made once per process)."""
    rows, failed = [], False
    for name, (spec_kind, env) in TE_VARIANTS.items():
        cmd = [sys.executable, __file__, "te-step", "--device", args.device, "--spec", spec_kind]
        extra = {"PORTSPEED_ACCELERATOR": args.device, **env}
        if spec_kind == "te":
            extra["PORTSPEED_DISABLE"] = ",".join(x for x in (os.environ.get("PORTSPEED_DISABLE", ""), PORTABLE_PATCH)
                                                  if x)
        try:
            out = _run(lambda: cmd, _env(**extra), args.timeout)  # te-step picks its own port at each start
            text = out.stdout + out.stderr
            line = [ln for ln in out.stdout.splitlines() if ln.startswith(RESULT)]
            row = ({"name": name, **json.loads(line[-1][len(RESULT):])} if out.returncode == 0 and line else
                   {"name": name, "error": f"exit {out.returncode}: {text[-500:]}"})
        except subprocess.TimeoutExpired as exc:
            text, row = str(exc), {"name": name, "error": f"timed out after {args.timeout} s"}
        (args.out / f"te_{spec_kind}_{len(rows)}.log").write_text(text)
        failed |= "error" in row
        rows.append(row)
        _write(args.out, "te", {"rows": rows})  # after every variant: a part stopped by its timeout keeps the rest
        print(json.dumps(row), flush=True)
    return 1 if failed else 0


# --------------------------------------------------------------------------------------------- the table
def _load(out: Path, part: str) -> dict[str, Any] | None:
    path = out / f"{part}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _status(out: Path, part: str) -> str:
    path = out / f"{part}.status"
    return path.read_text().strip() if path.is_file() else "not run"


def render(out: Path) -> str:
    """One table: a line per part (its figures, or why there are none), then the TE and attention figures."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_te_kernels import BACKEND_OPS
    from bench_te_kernels import table as attention_table

    lines = [f"{'part':<26}{'result':<8}detail"]
    summary: dict[str, str] = {}
    pre = _load(out, "preflight")
    if pre is not None:
        summary["preflight"] = (pre.get("error") or f"torch {pre['torch']}, {pre.get('gpu', 'no GPU')}, "
                                f"megatron-core {pre.get('megatron_core')}")
    conf = _load(out, "conformance")
    if conf is not None:
        checks = conf.get("checks", [])
        bad = [c for c in checks if not c["ok"]]
        skipped = sum(1 for c in checks if c.get("skipped"))
        summary["conformance"] = (f"adapter {conf.get('adapter')}: {len(checks) - len(bad) - skipped} passed, "
                                  f"{len(bad)} failed, {skipped} skipped" + (f"; first failure: {bad[0]['suite']}: "
                                                                             f"{bad[0]['name']}" if bad else ""))
    ex = _load(out, "example")
    if ex is not None:
        summary["example"] = ex.get("error") or (
            f"with portspeed {ex['with_ms']:.2f} ms/step, without {ex['without_ms']:.2f} ms/step, ratio "
            f"{ex['ratio']:.4f} (goal <= 1.005; ratio of minima {ex['min_ratio']:.4f}; steps {ex['steps']})"
            + ("; dry run: both runs have portspeed (Megatron needs its translation on CPU)"
               if pre is not None and pre.get("device") == "cpu" else ""))
    te_res = _load(out, "te")
    if te_res is not None:
        bad = [r["name"] for r in te_res["rows"] if "error" in r]
        summary["te"] = f"{len(te_res['rows']) - len(bad)} of {len(te_res['rows'])} variants ran" + (
            f"; failed: {', '.join(bad)}" if bad else "")
    att = _load(out, "attention")
    if att is not None:
        bad = [r for r in att if "error" in r]
        summary["attention"] = (f"{len(att) - len(bad)} of {len(att)} cases ran"
                                + (f", {len(bad)} failed" if bad else ""))
    for part in PARTS:
        status = _status(out, part)
        verdict = "ok" if status == "exit 0" else "FAILED"
        detail = summary.get(part, "no result file")
        if status != "exit 0":
            detail = f"{status}; {detail}; log: {out / (part + '.log')}"
        lines.append(f"{part:<26}{verdict:<8}{detail}")
    for status in sorted(out.glob("extra_*.status")):
        part = status.stem
        log = out / f"{part}.log"
        last = [ln for ln in (log.read_text(errors="replace").splitlines() if log.is_file() else []) if ln.strip()]
        state = status.read_text().strip()
        lines.append(f"{part[6:]:<26}{'ok' if state == 'exit 0' else 'FAILED':<8}{state}; last line: "
                     f"{last[-1][:150] if last else '(no output)'}; log: {log}")
    if te_res is not None:
        lines.append("")
        lines.append(f"{'TE step (example GPT)':<42}{'ms/step':>9}{'peak MB':>10}  SDPA backend (aten ops)")
        for r in te_res["rows"]:
            if "error" in r:
                lines.append(f"{r['name']:<42}  FAILED: {r['error'][-200:]}")
                continue
            ops = " ".join(r["sdpa_ops"])
            backend = next((b for op, b in BACKEND_OPS if op in ops), "none: matmul-softmax-matmul")
            lines.append(f"{r['name']:<42}{r['step_ms']:>9.2f}{r['peak_mb']:>10.0f}  {backend}"
                         + (f" ({', '.join(o.replace('aten::', '') for o in r['sdpa_ops'])})" if ops else ""))
    if att:
        lines.append("")
        lines.append(attention_table(att))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=("preflight", "example", "te", "te-step", "table"))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: the dry run, tiny, on the host")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("GPU_CHECK_OUT", "/tmp/gpu_check")))
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per subprocess")
    p.add_argument("--spec", choices=("te", "local"), default="te", help=argparse.SUPPRESS)  # te-step
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.command == "table":
        text = render(args.out)
        print(text)
        parts = list(PARTS) + [p.stem for p in args.out.glob("extra_*.status")]
        return 0 if all(_status(args.out, part) == "exit 0" for part in parts) else 1
    if args.command in ("example", "te", "te-step") and args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print(f"gpu_check {args.command}: --device cuda, but torch.cuda.is_available() is False "
                  f"(torch {torch.__version__}); use --device cpu for the dry run", file=sys.stderr)
            return 2
    return {"preflight": preflight, "example": example, "te": te, "te-step": te_step}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
