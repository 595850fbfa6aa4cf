"""The demo (`make demo`): a Megatron-Core GPT trained on CPU/Gloo with TP, PP and DP, and on the test device.

Every run goes through `portspeed run` (torchrun-compatible), starts from one shared
initial checkpoint so that layouts are comparable, and writes a JSON loss record. While a
layout trains, one progress line shows it (a bar on a terminal); at the end one table says,
per layout, the final loss, the largest |difference| from the single-process run (TP1) and
the verdict (fp32: |diff| <= 1e-5), and where the loss records, the comparison and a
loss-curve PNG were written. ``tp2-testdev`` runs TP2 on portspeed's test device (a C++
PrivateUse1 device with its own collective backend; a test device, not hardware).

What goes to the screen: portspeed's own messages. Framework warnings that say nothing to
a CPU user (Transformer Engine / Apex missing, deprecations) and torchrun's banners are
counted and written to ``framework-warnings.log`` in the work directory; ``--verbose``
prints everything as it comes. A run that fails prints the end of its log.

    python examples/demo.py                    # TP1, TP2, PP2, DP2, TP2xPP2, TP2 on the test device
    python examples/demo.py --layouts tp2 dp2  # a subset
    python examples/demo.py --iters 20 --workdir /tmp/demo --verbose
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRAINER = ROOT / "examples" / "pretrain_gpt.py"
FP32_ATOL = 1e-5

#: name -> (ranks, extra trainer flags)
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "tp1": (1, []),
    "tp2": (2, ["--tp", "2"]),
    "pp2": (2, ["--pp", "2"]),
    "dp2": (2, []),
    "tp2pp2": (4, ["--tp", "2", "--pp", "2"]),
    "tp2-testdev": (2, ["--tp", "2"]),
}
#: layouts that run on another adapter than the CPU (PORTSPEED_ACCELERATOR)
ACCELERATOR: dict[str, str] = {"tp2-testdev": "testdev"}

_LOSS = re.compile(r"^iteration (\d+) \| lm loss: (\S+)")
_PY_WARNING = re.compile(r"^(\S+):\d+: (\w*Warning): (.*)$")
_TORCHRUN_LOG = re.compile(r"^[WI]\d{4} \d\d:\d\d:\d\d")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Noise:
    """Framework warnings and launcher banners: counted, kept in a log file, off the screen."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        self.file = open(path, "w")
        self.lines = 0
        self.kinds: collections.Counter[str] = collections.Counter()
        self._in_warning = False

    def take(self, line: str) -> bool:
        """True when ``line`` is noise (then it is logged here); portspeed's own warnings never are."""
        m = _PY_WARNING.match(line)
        if m and "/portspeed/" not in m.group(1):
            self.kinds[f"{m.group(2)}: {m.group(3)[:90]}"] += 1
            self._in_warning = True
        elif self._in_warning and line.startswith((" ", "\t")):
            pass  # the source line Python prints under a warning
        elif _TORCHRUN_LOG.match(line):
            self._in_warning = False
        else:
            self._in_warning = False
            return False
        self.lines += 1
        self.file.write(line + "\n")
        return True

    def close(self) -> None:
        self.file.close()


class Progress:
    """One line per layout: redrawn in place on a terminal, printed once when it ends elsewhere."""

    def __init__(self, name: str, ranks: int, where: str, iters: int) -> None:
        self.name, self.ranks, self.where, self.iters = name, ranks, where, iters
        self.tty = sys.stdout.isatty()
        self.done, self.loss, self.t0 = 0, None, time.perf_counter()
        self.draw()

    def head(self) -> str:
        return f"{self.name:<12} {self.ranks} rank{'s' if self.ranks > 1 else ' '} {self.where:<9}"

    def draw(self) -> None:
        if not self.tty:
            return
        width = 20
        filled = width * self.done // max(self.iters, 1)
        loss = "" if self.loss is None else f"  lm loss {self.loss:.6f}"
        sys.stdout.write(f"\r{self.head()} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.iters}{loss}")
        sys.stdout.flush()

    def step(self, it: int, loss: float) -> None:
        self.done, self.loss = it, loss
        self.draw()

    def above(self, text: str) -> None:
        """Print a message without breaking the progress line."""
        if self.tty:
            sys.stdout.write("\r\033[K")
        print(text, flush=True)
        self.draw()

    def finish(self, ok: bool) -> None:
        took = time.perf_counter() - self.t0
        end = f"{self.done}/{self.iters} iterations in {took:.1f} s" + ("" if ok else "  FAILED")
        if self.tty:
            sys.stdout.write("\r\033[K")
        print(f"{self.head()} {end}", flush=True)


def launch(name: str, ranks: int, args: list[str], opts: argparse.Namespace, noise: Noise, log: pathlib.Path,
           iters: int, accelerator: str | None = None) -> None:
    """Run the trainer under `portspeed run` on `ranks` local processes; exit the demo if it fails."""
    cmd = [sys.executable, "-m", "portspeed.cli", "run", "--nproc-per-node", str(ranks),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(TRAINER), *args,
           "--transformer-impl", "local"]  # said on the command line: portspeed serves its portable TE otherwise
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PORTSPEED_ACCELERATOR=accelerator or os.environ.get("PORTSPEED_ACCELERATOR", "cpu"))
    where = "test dev" if accelerator else "CPU/Gloo"
    bar = Progress(name, ranks, where, iters)
    shown: set[tuple[str, str]] = set()
    with open(log, "w") as keep, subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                                  stderr=subprocess.STDOUT, text=True, bufsize=1) as proc:
        watchdog = threading.Timer(opts.timeout, proc.kill)  # a hung run is killed, even when it prints nothing
        watchdog.start()
        for raw in proc.stdout:  # type: ignore[union-attr]
            line = raw.rstrip("\n")
            keep.write(raw)
            m = _LOSS.match(line)
            if m:
                bar.step(int(m.group(1)), float(m.group(2)))
                if opts.verbose:
                    bar.above(line)
            elif opts.verbose:
                bar.above(line)
                noise.take(line)
            elif not noise.take(line) and ("portspeed" in line or line.startswith("router rewrites")) \
                    and not line.startswith("portspeed run: every worker") and (name, line) not in shown:
                shown.add((name, line))  # once per layout, not once per rank
                bar.above(f"  [{name}] {line}")
        code = proc.wait()
        watchdog.cancel()
    bar.finish(code == 0)
    if code != 0:
        tail = log.read_text().splitlines()[-40:]
        sys.exit("\n".join(tail) + f"\ndemo: {name} failed (exit {code}); its whole log: {log}\n{' '.join(cmd)}")


def _final_and_worst(record: pathlib.Path, ref: dict[int, float]) -> tuple[float, float]:
    its = {e["iteration"]: e["lm_loss"] for e in json.loads(record.read_text())["iterations"]}
    last = its[max(its)]
    worst = max(abs(its[i] - ref[i]) for i in its) if ref else 0.0
    return last, worst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--workdir", default=None, help="where checkpoints, loss records and logs go (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run before it is killed")
    p.add_argument("--verbose", action="store_true", help="print every line of every run (framework warnings too)")
    args = p.parse_args(argv)
    if args.iters < 1:
        p.error(f"--iters {args.iters}: train at least 1 iteration")

    t0 = time.perf_counter()
    work = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="portspeed-demo-")).resolve()
    (work / "logs").mkdir(parents=True, exist_ok=True)
    noise = Noise(work / "framework-warnings.log")
    init = work / "init-ckpt"
    print(f"portspeed demo: a Megatron-Core GPT ({args.iters} iterations per layout) from one initial checkpoint; "
          f"work directory {work}", flush=True)
    launch("init", 1, ["--iters", "0", "--save", str(init)], args, noise, work / "logs" / "init.log", 0)

    layouts = ["tp1"] + [name for name in args.layouts if name != "tp1"]
    records: dict[str, pathlib.Path] = {}
    for name in layouts:
        ranks, flags = LAYOUTS[name]
        records[name] = work / f"{name}.json"
        launch(name, ranks, [*flags, "--iters", str(args.iters), "--load", str(init), "--finetune",
                             "--loss-log", str(records[name])], args, noise, work / "logs" / f"{name}.log",
               args.iters, ACCELERATOR.get(name))
    noise.close()

    cmp = [sys.executable, "-m", "portspeed.cli", "compare", *map(str, records.values()), "--atol", str(FP32_ATOL),
           "--markdown", str(work / "parity.md"), "--json", str(work / "parity.json"), "--plot", str(work / "loss.png")]
    res = subprocess.run(cmp, cwd=ROOT, capture_output=True, text=True)
    (work / "compare.txt").write_text(res.stdout + res.stderr)

    ref = {e["iteration"]: e["lm_loss"] for e in json.loads(records["tp1"].read_text())["iterations"]}
    print(f"\n{'layout':<12} {'ranks':>5}  {'device':<9} {'final loss':>12}  {'max |diff| vs tp1':>17}  verdict")
    for name, rec in records.items():
        last, worst = _final_and_worst(rec, {} if name == "tp1" else ref)
        verdict = "reference" if name == "tp1" else ("equal" if worst <= FP32_ATOL else "DIFFERS")
        device = "test dev" if name in ACCELERATOR else "CPU/Gloo"
        diff = "-" if name == "tp1" else f"{worst:.2e}"
        print(f"{name:<12} {LAYOUTS[name][0]:>5}  {device:<9} {last:>12.6f}  {diff:>17}  {verdict}")
    took = time.perf_counter() - t0
    kinds = len(noise.kinds)
    print(f"\nfp32 band: |diff| <= {FP32_ATOL:g} at every iteration; compare exit status {res.returncode} "
          f"({'all layouts equal' if res.returncode == 0 else 'a layout differs: see compare.txt'}); "
          f"{took:.0f} s in all")
    print(f"loss records: {work}/<layout>.json   comparison: {work / 'parity.md'}   "
          f"loss curves: {work / 'loss.png' if (work / 'loss.png').exists() else '(not drawn: see compare.txt)'}")
    print(f"framework warnings: {noise.lines} lines ({kinds} distinct: Transformer Engine / Apex missing, "
          f"deprecations, torchrun banners) in {noise.path}; --verbose prints them")
    return res.returncode


if __name__ == "__main__":
    sys.exit(main())
