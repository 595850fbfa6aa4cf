"""The stock matrix: Megatron-LM's own ``pretrain_gpt.py`` at every supported tag, in every layout and launch.

Why: ``versions.SUPPORTED`` is a promise that every release inside it runs the stock script in
every way users start it. ``make test-stock`` checks one checkout at a time from a temporary
folder; this runs them all, the way Megatron-LM's example scripts launch them too, and writes
the answer into docs/megatron.md. By hand, not CI: it needs a Megatron-LM git directory
(``MEGATRON_LM_GIT``, the mirror the ``fetch`` tool gives) and about an hour on 2 cores.

For each tag (``git archive`` into a temporary tree), on the leg whose Python it needs
(0.15/0.16: ``.venv``; 0.17 on: ``.venv312``):

1. a TP1 run on Megatron's default Transformer Engine path (portspeed's portable TE) trains
   ``INIT_ITERS`` iterations and saves the shared checkpoint (layouts seed their initialisation
   differently, so they are compared from the same weights);
2. the TP1 reference fine-tunes ``ITERS`` iterations from it (``--transformer-impl local``);
3. every cell fine-tunes the same iterations from it and is compared with TP1: max |delta lm loss|
   over the iterations, or the first error line of its log.

Launches (the three ways users start it):

* ``root``: cwd is the checkout, ``torchrun pretrain_gpt.py ...`` with
  ``import portspeed.megatron_adaptor`` as the script's first line (Megatron-LM's examples/);
* ``run``: ``portspeed run <checkout>/pretrain_gpt.py`` from another folder (unedited script);
* ``wrapper``: ``torchrun wrapper.py`` from another folder, the wrapper importing the adaptor and
  running the unedited script with ``runpy``.

Mock data with ``--vocab-size 4095``: core_v0.15.3's mock dataset emits token ids up to 4095
whatever the vocabulary (``megatron/core/datasets/gpt_dataset.py``, ``MockGPTLowLevelDataset.__getitem__``;
0.16 takes them modulo the vocabulary), and 4095 + the NullTokenizer's end-of-document token
pads to 4096 for TP 1 and 2 alike, so every layout trains the same model.

    MEGATRON_LM_GIT=/work/.mirror/NVIDIA+Megatron-LM/repo make test-stock-matrix
    .venv/bin/python benchmarks/stock_matrix.py --git $MEGATRON_LM_GIT --tags core_v0.16.1 main --no-docs
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from portspeed.parity.losslog import LossLogError, parse_megatron_log  # noqa: E402

TAGS = ("core_v0.15.3", "core_v0.16.1", "core_v0.17.1", "core_v0.18.2", "core_v0.19.0", "main")
TOLERANCE = 1e-5  # absolute, per iteration, fp32
INIT_ITERS = 2
ITERS = 3
RUN_TIMEOUT = 600  # seconds per launch
ADAPTOR_LINE = "import portspeed.megatron_adaptor  # portspeed: first line, as the README says\n"

#: (layout, launch) -> (processes, flags); TE cells pass no --transformer-impl (Megatron's default)
CELLS: dict[tuple[str, str], tuple[int, tuple[str, ...]]] = {
    ("TP2", "root"): (2, ("--tensor-model-parallel-size", "2")),
    ("PP2", "root"): (2, ("--pipeline-model-parallel-size", "2")),
    ("DP2", "root"): (2, ()),
    ("TP2xPP2", "root"): (4, ("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2")),
    ("TP2 TE", "root"): (2, ("--tensor-model-parallel-size", "2")),
    ("TP2", "run"): (2, ("--tensor-model-parallel-size", "2")),
    ("TP2", "wrapper"): (2, ("--tensor-model-parallel-size", "2")),
}

MODEL = ("--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "4095",
         "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
         "--lr-warmup-iters", "2", "--lr-decay-iters", "10", "--weight-decay", "0.01", "--clip-grad", "1.0",
         "--seed", "1234", "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--log-interval", "1",
         "--eval-iters", "0", "--num-workers", "0")

WRAPPER = '''"""Start Megatron-LM's unedited pretrain_gpt.py after importing portspeed's adaptor (stock matrix)."""
import portspeed.megatron_adaptor  # noqa: F401
import runpy, sys
script = {script!r}
sys.argv[0] = script
sys.path.insert(0, {root!r})
runpy.run_path(script, run_name="__main__")
'''


def _minor(tree: Path) -> int:
    text = (tree / "megatron" / "core" / "package_info.py").read_text()
    return int(re.search(r"^MINOR\s*=\s*(\d+)", text, re.M).group(1))


def _release(tree: Path) -> str:
    text = (tree / "megatron" / "core" / "package_info.py").read_text()
    parts = [re.search(rf"^{k}\s*=\s*(\d+)", text, re.M).group(1) for k in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(parts)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_error(text: str) -> str:
    """The first ``SomethingError: ...`` line of a failed run's log (rank prefixes dropped), else its last line."""
    for line in text.splitlines():
        bare = re.sub(r"^\[rank\d+\]:\s*", "", line).strip()
        if re.match(r"^[\w.]*(Error|Exception|Interrupt)(:|$)", bare):
            return bare[:300]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "(empty log)"


@dataclass
class Leg:
    """The Python a tag runs on: its venv's interpreter, and PATH with its bin and the base Python's bin first."""

    python: Path

    def env(self) -> dict[str, str]:
        base = subprocess.run([str(self.python), "-c", "import sys; print(sys.base_prefix)"],
                              capture_output=True, text=True, check=True).stdout.strip()
        env = {k: v for k, v in os.environ.items() if k != "PORTSPEED_BACKEND"}
        # Megatron builds its dataset helpers with `python3 -m pybind11` and `python3-config`: both this leg's
        env["PATH"] = os.pathsep.join((str(self.python.parent), f"{base}/bin", env.get("PATH", "")))
        env.update(OMP_NUM_THREADS="1", PORTSPEED_ACCELERATOR="cpu", PYTHONWARNINGS="ignore")
        return env


@dataclass
class Row:
    """One tag's results: cell -> max |delta| (float) or the first error line (str)."""

    tag: str
    commit: str
    release: str = ""
    leg: str = ""
    cells: dict[tuple[str, str], float | str] = field(default_factory=dict)
    seconds: float = 0.0
    measured: str = ""


class TagRun:
    """One exported tag and its runs, each log kept under ``work``."""

    def __init__(self, tree: Path, work: Path, leg: Leg) -> None:
        self.tree, self.work, self.leg = tree, work, leg
        self.env = leg.env()
        self.script = tree / "pretrain_gpt.py"
        self.original = self.script.read_text()
        self.wrapper = work / "wrapper.py"
        self.wrapper.write_text(WRAPPER.format(script=str(self.script), root=str(tree)))
        self.ckpt = work / "ckpt"

    def _cmd(self, launch: str, nproc: int) -> tuple[list[str], Path, dict[str, str]]:
        rdzv = ["--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(_free_port())]
        torchrun = [str(self.leg.python), "-m", "torch.distributed.run"]
        if launch == "root":
            self.script.write_text(ADAPTOR_LINE + self.original)
            return [*torchrun, *rdzv, "pretrain_gpt.py"], self.tree, self.env
        self.script.write_text(self.original)
        env = self.env | {"PYTHONPATH": os.pathsep.join(p for p in (str(self.tree), self.env.get("PYTHONPATH")) if p)}
        if launch == "run":
            return [str(self.leg.python), "-m", "portspeed.cli", "run", *rdzv, str(self.script)], self.work, env
        return [*torchrun, *rdzv, str(self.wrapper)], self.work, self.env

    def launch(self, name: str, launch: str, nproc: int, *flags: str) -> tuple[int, str]:
        """Run one launch to its end (its process group killed at RUN_TIMEOUT); (exit status, log text)."""
        cmd, cwd, env = self._cmd(launch, nproc)
        log = self.work / f"{name}.log"
        with open(log, "w") as out:
            out.write(f"# cwd {cwd}\n# {' '.join(cmd + list(flags))}\n")
            out.flush()
            proc = subprocess.Popen(cmd + list(flags), cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=RUN_TIMEOUT)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = -9
        text = log.read_text()
        if rc == -9:
            text += f"\nTimeoutError: killed after {RUN_TIMEOUT}s\n"
        return rc, text

    def finetune(self, name: str, launch: str, nproc: int, flags: tuple[str, ...], te: bool) -> tuple[dict, str]:
        impl = () if te else ("--transformer-impl", "local")
        rc, text = self.launch(name, launch, nproc, *MODEL, *impl, "--train-iters", str(ITERS),
                               "--eval-interval", str(ITERS), "--load", str(self.ckpt), "--finetune", *flags)
        if rc != 0:
            return {}, first_error(text)
        try:
            rec = parse_megatron_log(text, source=name)
        except LossLogError as exc:
            return {}, f"unreadable log: {exc}"
        losses = {it.iteration: it.lm_loss for it in rec.iterations}
        if sorted(losses) != list(range(1, ITERS + 1)):
            return {}, f"logged iterations {sorted(losses)}, expected 1..{ITERS}"
        return losses, ""

    def restore(self) -> None:
        self.script.write_text(self.original)


def export(git: Path, tag: str, prefix: str, keep: Path | None) -> tuple[Path, Path, Path]:
    """``tag`` exported with ``git archive`` into a new folder: (the folder, its Megatron-LM tree, its work folder)."""
    known = subprocess.run(["git", f"--git-dir={git}", "rev-parse", "--verify", "-q", f"{tag}^{{commit}}"],
                           capture_output=True)
    if known.returncode != 0:
        raise RuntimeError(f"{tag!r} is no tag or branch of {git}: name one it has (git --git-dir={git} tag)")
    base = Path(tempfile.mkdtemp(prefix=f"{prefix}-{tag}-", dir=keep))
    tree, work = base / "Megatron-LM", base / "work"
    tree.mkdir()
    work.mkdir()
    archive = subprocess.Popen(["git", f"--git-dir={git}", "archive", tag], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(tree)], stdin=archive.stdout, check=True)
    archive.wait()
    return base, tree, work


def run_tag(git: Path, tag: str, legs: dict[str, Leg], keep: Path | None, log=print) -> Row:
    """Export ``tag``, save the shared checkpoint, run TP1 and every cell; the row."""
    commit = subprocess.run(["git", f"--git-dir={git}", "rev-parse", "--short=10", f"{tag}^{{commit}}"],
                            capture_output=True, text=True, check=True).stdout.strip()
    row = Row(tag, commit)
    start = time.monotonic()
    base, tree, work = export(git, tag, "stock-matrix", keep)
    row.release = _release(tree)
    leg_name = ".venv" if _minor(tree) <= 16 else ".venv312"
    row.leg = leg_name
    run = TagRun(tree, work, legs[leg_name])
    try:
        rc, text = run.launch("save", "root", 1, *MODEL, "--train-iters", str(INIT_ITERS), "--eval-interval",
                              str(INIT_ITERS), "--save", str(run.ckpt), "--save-interval", str(INIT_ITERS))
        if rc != 0:
            row.cells = {cell: f"checkpoint save failed: {first_error(text)}" for cell in CELLS}
            return row
        ref, err = run.finetune("tp1", "root", 1, (), te=False)
        if err:
            row.cells = {cell: f"TP1 reference failed: {err}" for cell in CELLS}
            return row
        for (layout, launch), (nproc, flags) in CELLS.items():
            name = f"{layout.replace(' ', '_').lower()}-{launch}"
            got, err = run.finetune(name, launch, nproc, flags, te=layout.endswith("TE"))
            row.cells[(layout, launch)] = err or max(abs(got[i] - ref[i]) for i in ref)
            log(f"  {tag} {layout:8} {launch:8} {fmt(row.cells[(layout, launch)])}")
    finally:
        run.restore()
        row.seconds = time.monotonic() - start
        if keep is None:
            shutil.rmtree(base, ignore_errors=True)
        else:
            log(f"  {tag}: logs in {work}")
    return row


def now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def _merge_rows(path: Path, fresh: list[Row], when: str) -> list[Row]:
    """Rows of ``path`` for tags not in ``fresh``, then ``fresh`` (stamped ``when``), in TAGS order; written back."""
    old = {}
    if path.is_file():
        for d in json.loads(path.read_text()):
            cells = {tuple(k.split("|")): v for k, v in d.pop("cells").items()}
            old[d["tag"]] = Row(**d, cells=cells)
    for r in fresh:
        r.measured = when
        old[r.tag] = r
    order = {t: i for i, t in enumerate(TAGS)}
    rows = sorted(old.values(), key=lambda r: order.get(r.tag, len(order)))
    path.write_text(json.dumps([dataclasses.asdict(r) | {"cells": {"|".join(k): v for k, v in r.cells.items()}}
                                for r in rows], indent=1))
    return rows


def fmt(value: float | str) -> str:
    if isinstance(value, str):
        return f"FAIL: {value}"
    return f"{value:.1e}" + ("" if value <= TOLERANCE else " (> 1e-5)")


def table(rows: list[Row]) -> str:
    """Markdown: one row per tag, one column per (layout, launch)."""
    head = ["tag (commit)", "release", "leg", *[f"{lay} {lau}" for lay, lau in CELLS], "time", "measured"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [fmt(r.cells[c]).replace("|", "\\|") if c in r.cells else "not run" for c in CELLS]
        out.append(f"| `{r.tag}` ({r.commit}) | {r.release} | {r.leg} | " + " | ".join(cells)
                   + f" | {r.seconds / 60:.1f} min | {r.measured or 'this run'} |")
    return "\n".join(out)


BEGIN, END = "<!-- stock-matrix:begin -->", "<!-- stock-matrix:end -->"


def write_docs(doc: Path, text: str) -> None:
    """Replace the block between the stock-matrix markers in ``doc`` (appended under a heading if absent)."""
    block = f"{BEGIN}\n{text}\n{END}"
    current = doc.read_text()
    if BEGIN in current and END in current:
        pre, _, rest = current.partition(BEGIN)
        _, _, post = rest.partition(END)
        doc.write_text(pre + block + post)
    else:
        doc.write_text(current.rstrip("\n") + "\n\n## The stock matrix\n\n" + block + "\n")


def checked_legs(p: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Leg]:
    """The two legs from ``--venv`` / ``--venv312``, after checking ``--git`` and them (``p.error`` otherwise);
    ``--keep`` is created. Shared with benchmarks/probe_stock_tags.py."""
    if not args.git or not Path(args.git).is_dir():
        p.error("set MEGATRON_LM_GIT (or --git) to a Megatron-LM git directory, e.g. the fetch tool's "
                "/work/.mirror/NVIDIA+Megatron-LM/repo")
    legs = {".venv": Leg(Path(args.venv).absolute() / "bin" / "python"),  # launches run from other folders
            ".venv312": Leg(Path(args.venv312).absolute() / "bin" / "python")}
    for name, leg in legs.items():
        if not leg.python.is_file():
            p.error(f"{leg.python} is missing: build {name} first (make venv / make venv312)")
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    return legs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--git", default=os.environ.get("MEGATRON_LM_GIT"),
                   help="Megatron-LM git directory (default: $MEGATRON_LM_GIT)")
    p.add_argument("--tags", nargs="+", default=list(TAGS))
    p.add_argument("--venv", default=str(REPO / ".venv"), help="leg 1 (core 0.15, 0.16)")
    p.add_argument("--venv312", default=str(REPO / ".venv312"), help="leg 2 (core 0.17 on)")
    p.add_argument("--keep", type=Path, help="keep trees and logs under this folder")
    p.add_argument("--no-docs", action="store_true", help="print the table only")
    p.add_argument("--rows", type=Path, help="JSON file of rows: rows of tags not run now are read from it (rerun "
                   "one tag and keep the others), and every row is written back")
    args = p.parse_args(argv)
    legs = checked_legs(p, args)
    start, load0 = time.monotonic(), os.getloadavg()
    rows = []
    for tag in args.tags:
        print(f"{tag} ...", flush=True)
        rows.append(run_tag(Path(args.git), tag, legs, args.keep, log=lambda s: print(s, flush=True)))
    minutes, load1 = (time.monotonic() - start) / 60, os.getloadavg()
    if args.rows:
        rows = _merge_rows(args.rows, rows, f"{now_utc()}, load {load0[0]:.1f}..{load1[0]:.1f}")
    now = now_utc()
    text = (f"Measured {now} on {os.cpu_count()} cores, {minutes:.0f} min in all (1-min load "
            f"{load0[0]:.1f} at the start, {load1[0]:.1f} at the end; 15-min {load1[2]:.1f}); "
            f"{INIT_ITERS} iterations saved the shared checkpoint, {ITERS} fine-tuned in each cell; "
            f"each cell is the max |delta lm loss| against TP1 (`--transformer-impl local`, root launch), "
            f"equal within {TOLERANCE:g}, or its first error line.\n\n" + table(rows))
    print(text)
    if not args.no_docs:
        write_docs(REPO / "docs" / "megatron.md", text)
        print(f"written to {REPO / 'docs' / 'megatron.md'}")
    bad = [r for r in rows for v in r.cells.values() if isinstance(v, str) or v > TOLERANCE]
    return 1 if bad or any(len(r.cells) < len(CELLS) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
