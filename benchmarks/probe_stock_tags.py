"""The probe on stock ``pretrain_gpt.py`` at every supported tag: clean layouts agree, planted faults are named.

Why: ``portspeed run --probe`` must work on Megatron-LM's own unedited script at every tag inside
``versions.SUPPORTED``, not only at the one tag docs/accuracy.md walks through. CI runs the probe on
the example trainer; this runs it on each tag's stock script. By hand, not CI: it needs a Megatron-LM
git directory (``MEGATRON_LM_GIT``, the ``fetch`` tool's mirror) and 2.5-4 minutes a tag on 2 cores (18 min
for the six tags, 2026-11-27, beside a CI run).

For each tag (exported with ``git archive``; 0.15/0.16 on ``.venv``, 0.17 on ``.venv312``, as
benchmarks/stock_matrix.py), every launch through ``portspeed run`` from a folder outside the tree:

1. ``save``: one iteration saves the weights both layouts start from (local spec; and a TE-spec
   RMSNorm one for the kernel fault);
2. ``bitwise``: TP1 unprobed and TP1 probed (iterations 1-3): the printed losses and grad norms equal;
3. ``tp2 clean``: TP2 probed, ``compare --probe`` against TP1: exit 0;
4. ``reduce-avg``: TP2 with layer 1's row-parallel all_reduce averaged in iteration 1 (TEST-ONLY
   plant, tests/data/plants): exit 1, the first line names ``decoder.layers.1.self_attention.linear_proj``,
   iteration 1, forward;
5. ``nan``: TP1 with one NaN in layer 1's output at iteration 3 and ``--probe-nan``: the job stops
   non-zero and its line names ``decoder.layers.1``, iteration 3;
6. ``rms_norm``: the test device with its vendor ``rms_norm`` off by 1e-3 (tests/data/testdev_rms_off.py)
   against the CPU, TE spec, op level: exit 1, the first line names op ``rms_norm`` in layer 0.

    MEGATRON_LM_GIT=/work/.mirror/NVIDIA+Megatron-LM/repo .venv/bin/python benchmarks/probe_stock_tags.py
    .venv/bin/python benchmarks/probe_stock_tags.py --git $MEGATRON_LM_GIT --tags core_v0.15.3 main --keep /tmp/p
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stock_matrix import (MODEL, REPO, TAGS, Leg, TagRun, _free_port, _minor,  # noqa: E402
                          _release, checked_legs, export, first_error)

LOCAL = (*MODEL, "--transformer-impl", "local")
TE = (*MODEL, "--normalization", "RMSNorm")  # Megatron's default TE spec: portspeed's portable TE
FINETUNE = ("--train-iters", "3", "--eval-interval", "3", "--finetune")
RMS_OFF = str(REPO / "tests" / "data" / "testdev_rms_off.py") + ":TestdevRmsOff"
#: what each check's first line (or the nan run's log) must say
WANT = {
    "reduce-avg": ("iteration 1, micro-batch 0, forward, decoder.layers.1.self_attention.linear_proj,",),
    "nan": ("non-finite at iteration 3", "forward: decoder.layers.1 (TransformerLayer)"),
    "rms_norm": ("iteration 1, micro-batch 0, forward, decoder.layers.0.", "op rms_norm #0"),
}
CHECKS = ("bitwise", "tp2 clean", "reduce-avg", "nan", "rms_norm")


class ProbeTag:
    """One exported tag: ``portspeed run`` launches with probe switches, and ``compare --probe``."""

    def __init__(self, run: TagRun) -> None:
        self.run, self.work = run, run.work

    def launch(self, name: str, nproc: int, flags: tuple[str, ...], probe: tuple[str, ...] = (),
               adaptor: tuple[str, ...] = (), env: dict[str, str] | None = None) -> tuple[int, str]:
        rdzv = ("--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(_free_port()))
        paths = [str(self.run.tree), str(REPO / "tests" / "data") if adaptor else "",
                 self.run.env.get("PYTHONPATH", "")]
        full = self.run.env | {"PYTHONPATH": os.pathsep.join(p for p in paths if p)} | (env or {})
        cmd = [str(self.run.leg.python), "-m", "portspeed.cli", "run", *adaptor, *probe, *rdzv,
               str(self.run.script), *flags]
        log = self.work / f"{name}.log"
        with open(log, "w") as out:
            out.write(f"# cwd {self.work}\n# {' '.join(cmd)}\n")
            out.flush()
            rc = subprocess.run(cmd, cwd=self.work, env=full, stdout=out, stderr=subprocess.STDOUT,
                                timeout=900).returncode
        return rc, log.read_text()

    def compare(self, ref: str, run: str) -> tuple[int, str]:
        res = subprocess.run([str(self.run.leg.python), "-m", "portspeed.cli", "compare", "--probe",
                              str(self.work / ref), str(self.work / run)], capture_output=True, text=True,
                             env=self.run.env, timeout=600)
        (self.work / f"compare-{run}.txt").write_text(res.stdout + res.stderr)
        lines = (res.stdout or res.stderr).splitlines()
        return res.returncode, lines[0] if lines else "(no output)"


def _printed(text: str) -> list[str]:
    """Megatron's printed ``lm loss`` and ``grad norm`` fields, in order (rank prefixes dropped)."""
    return re.findall(r"(?:lm loss|grad norm): [0-9.E+-]+", text)


def run_tag(git: Path, tag: str, legs: dict[str, Leg], keep: Path | None, log=print) -> dict[str, str]:
    """Export ``tag``, run the five checks; check -> 'ok: ...' or what went wrong."""
    base, tree, work = export(git, tag, "probe-stock", keep)
    leg = legs[".venv" if _minor(tree) <= 16 else ".venv312"]
    p = ProbeTag(TagRun(tree, work, leg))
    out: dict[str, str] = {"release": _release(tree)}
    probe = ("--probe-iterations", "1:3")
    plant = ("--adaptor", "plants.megatron_adaptor")
    try:
        rc, text = p.launch("save", 1, (*LOCAL, "--train-iters", "1", "--eval-interval", "1", "--save",
                                        str(work / "ckpt"), "--save-interval", "1"))
        if rc:
            return out | {c: f"checkpoint save failed: {first_error(text)}" for c in CHECKS}
        tune = (*LOCAL, "--load", str(work / "ckpt"), *FINETUNE)
        rc0, plain = p.launch("tp1", 1, tune)
        rc1, probed = p.launch("tp1-probe", 1, tune, ("--probe", str(work / "probe-tp1"), *probe))
        a, b = _printed(plain), _printed(probed)
        out["bitwise"] = (f"exit {rc0}/{rc1}: {first_error(plain if rc0 else probed)}" if rc0 or rc1 else
                          f"ok: {len(a)} printed values equal" if a == b and len(a) == 6 else f"differ: {a} vs {b}")
        tp2 = (*tune, "--tensor-model-parallel-size", "2")
        rc, text = p.launch("tp2-probe", 2, tp2, ("--probe", str(work / "probe-tp2"), *probe))
        rc, line = (rc, first_error(text)) if rc else p.compare("probe-tp1", "probe-tp2")
        out["tp2 clean"] = f"ok: {line}" if rc == 0 else f"exit {rc}: {line}"
        rc, text = p.launch("tp2-avg", 2, tp2, ("--probe", str(work / "probe-tp2-avg"), *probe), plant,
                            {"PORTSPEED_PLANT": "reduce-avg:1:1"})
        rc, line = (-1, first_error(text)) if rc else p.compare("probe-tp1", "probe-tp2-avg")
        out["reduce-avg"] = f"ok: {line}" if rc == 1 and all(w in line for w in WANT["reduce-avg"]) else \
            f"exit {rc}: {line}"
        rc, text = p.launch("nan", 1, tune, ("--probe", str(work / "probe-nan"), *probe, "--probe-nan"), plant,
                            {"PORTSPEED_PLANT": "nan:3:1"})
        said = [ln for ln in text.splitlines() if "non-finite at iteration" in ln]
        out["nan"] = (f"ok: {said[0].split('portspeed probe: ', 1)[-1][:160]}"
                      if rc != 0 and said and all(w in said[0] for w in WANT["nan"])
                      else f"exit {rc}: {said[0] if said else first_error(text)}")
        rc, text = p.launch("te-save", 1, (*TE, "--train-iters", "1", "--eval-interval", "1", "--save",
                                           str(work / "te-ckpt"), "--save-interval", "1"))
        te = (*TE, "--load", str(work / "te-ckpt"), "--train-iters", "1", "--eval-interval", "1", "--finetune")
        op = ("--probe-level", "op")
        rc0, t0 = (rc, text) if rc else p.launch("te-cpu", 1, te, ("--probe", str(work / "probe-cpu-op"), *op))
        rc1, t1 = (rc0, t0) if rc0 else p.launch("te-dev", 1, te, ("--probe", str(work / "probe-dev-op"), *op),
                                                  env={"PORTSPEED_ACCELERATOR": RMS_OFF})
        rc, line = (-1, first_error(t1)) if rc1 else p.compare("probe-cpu-op", "probe-dev-op")
        out["rms_norm"] = f"ok: {line}" if rc == 1 and all(w in line for w in WANT["rms_norm"]) else \
            f"exit {rc}: {line}"
    finally:
        p.run.restore()
        if keep is None:
            shutil.rmtree(base, ignore_errors=True)
        else:
            log(f"  {tag}: logs in {work}")
    return out


def tags_main(description: str, run_tag, checks: tuple[str, ...], argv: list[str] | None = None) -> int:
    """Parse the tags' command line, run ``run_tag`` on each tag and print its checks; 1 if any is not 'ok: '.
    Shared with benchmarks/perf_stock_tags.py."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--git", default=os.environ.get("MEGATRON_LM_GIT"), help="Megatron-LM git directory")
    ap.add_argument("--tags", nargs="+", default=list(TAGS))
    ap.add_argument("--venv", default=str(REPO / ".venv"), help="leg 1 (core 0.15, 0.16)")
    ap.add_argument("--venv312", default=str(REPO / ".venv312"), help="core 0.17 on")
    ap.add_argument("--keep", type=Path, help="keep trees, logs and recordings under this folder")
    args = ap.parse_args(argv)
    legs = checked_legs(ap, args)
    bad = 0
    for tag in args.tags:
        start = time.monotonic()
        row = run_tag(Path(args.git), tag, legs, args.keep)
        print(f"{tag} (megatron-core {row.pop('release')}, {time.monotonic() - start:.0f} s)", flush=True)
        for check in checks:
            print(f"  {check:12} {row[check]}", flush=True)
            bad += not row[check].startswith("ok: ")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    return tags_main(__doc__.split("\n")[0], run_tag, CHECKS, argv)


if __name__ == "__main__":
    sys.exit(main())
