"""``--perf`` on stock ``pretrain_gpt.py`` at every supported tag: clean pairs name nothing, planted slowness is named.

Why: ``portspeed run --perf`` must time Megatron-LM's own unedited script at every tag inside
``versions.SUPPORTED``, as the probe does (benchmarks/probe_stock_tags.py); CI times the example trainer. By hand,
not CI: it needs a Megatron-LM git directory (``MEGATRON_LM_GIT``, the ``fetch`` tool's mirror) and a few minutes
a tag on 2 cores.

For each tag (exported with ``git archive``; 0.15/0.16 on ``.venv``, 0.17 on ``.venv312``), every launch through
``portspeed run --perf`` from a folder outside the tree, local spec, iterations 2-4 recorded, 4 micro-batches an
iteration; the plants come in through ``--adaptor plants.megatron_adaptor`` (TEST-ONLY, tests/data/plants):

1. ``clean pair``: TP1 twice on the CPU; ``compare --perf`` of the two exits 0 (the threshold holds);
2. ``slow module``: TP1 on the test device with decoder layer 1's MLP forward sleeping 40 ms, against the clean
   CPU run: exit 1, the first line names ``decoder.layers.1.mlp`` forward;
3. ``item``: TP1 on the CPU with four ``.item()`` calls in layer 1's MLP forward: exit 1, the first line names
   that module and counts 16 host syncs an iteration;
4. ``slow rank``: TP2 with rank 1's every MLP forward sleeping 60 ms; ``compare --perf`` of that one run names
   rank 1 (and the clean TP2 run names no slow rank).

    MEGATRON_LM_GIT=/work/.mirror/NVIDIA+Megatron-LM/repo make test-perf-stock
    .venv/bin/python benchmarks/perf_stock_tags.py --git $MEGATRON_LM_GIT --tags core_v0.16.1 main --keep /tmp/p
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_stock_tags import LOCAL, ProbeTag, tags_main  # noqa: E402
from stock_matrix import TagRun, _minor, _release, export, first_error  # noqa: E402

ITERS = ("--train-iters", "5", "--eval-interval", "5")
PERF = ("--perf-iterations", "2:4")
PLANT = ("--adaptor", "plants.megatron_adaptor")
ITEMS, MICRO_BATCHES = 4, 4  # --global-batch-size 8 / --micro-batch-size 2, one data-parallel rank
#: what each check's first line must say
WANT = {
    "slow module": ("slowest part: iteration ", "decoder.layers.1.mlp forward", "rank 0"),
    "item": ("decoder.layers.1.mlp forward", f"{ITEMS * MICRO_BATCHES} host syncs (.item() x{ITEMS * MICRO_BATCHES}"),
    "slow rank": ("slow rank: rank 1 arrives last at ",),
}
CHECKS = ("clean pair", "slow module", "item", "slow rank")


class PerfTag(ProbeTag):
    """One exported tag: ``portspeed run --perf`` launches, and ``compare --perf`` of one run or two."""

    def perf(self, name: str, nproc: int, flags: tuple[str, ...], plant: str = "", device: str = "cpu") -> str:
        """Launch ``name`` recording into ``work/name``; '' when it exited 0, else its first error."""
        env = {"PORTSPEED_ACCELERATOR": device} | ({"PORTSPEED_PLANT": plant} if plant else {})
        rc, text = self.launch(name, nproc, (*LOCAL, *ITERS, *flags), ("--perf", str(self.work / name), *PERF),
                               PLANT if plant else (), env)
        return f"{name} exit {rc}: {first_error(text)}" if rc else ""

    def compare_perf(self, *runs: str) -> tuple[int, str]:
        res = subprocess.run([str(self.run.leg.python), "-m", "portspeed.cli", "compare", "--perf",
                              *(str(self.work / r) for r in runs)], capture_output=True, text=True,
                             env=self.run.env, timeout=600)
        (self.work / f"compare-{'-'.join(runs)}.txt").write_text(res.stdout + res.stderr)
        lines = (res.stdout or res.stderr).splitlines()
        return res.returncode, lines[0] if lines else "(no output)"


def _named(rc: int, line: str, check: str) -> str:
    return f"ok: {line}" if rc == 1 and all(w in line for w in WANT[check]) else f"exit {rc}: {line}"


def run_tag(git: Path, tag: str, legs: dict, keep: Path | None, log=print) -> dict[str, str]:
    """Export ``tag``, run the four checks; check -> 'ok: ...' or what went wrong."""
    base, tree, work = export(git, tag, "perf-stock", keep)
    leg = legs[".venv" if _minor(tree) <= 16 else ".venv312"]
    p = PerfTag(TagRun(tree, work, leg))
    out: dict[str, str] = {"release": _release(tree)}
    tp2 = ("--tensor-model-parallel-size", "2")
    try:
        failed = p.perf("ref", 1, ()) or p.perf("ref-again", 1, ())
        rc, line = (-1, failed) if failed else p.compare_perf("ref", "ref-again")
        out["clean pair"] = f"ok: {line}" if rc == 0 else f"exit {rc}: {line}"
        failed = p.perf("slow-module", 1, (), "slow:1:40", "testdev")
        rc, line = (-1, failed) if failed else p.compare_perf("ref", "slow-module")
        out["slow module"] = _named(rc, line, "slow module")
        failed = p.perf("item", 1, (), f"item:1:{ITEMS}")
        rc, line = (-1, failed) if failed else p.compare_perf("ref", "item")
        out["item"] = _named(rc, line, "item")
        failed = p.perf("tp2", 2, tp2) or p.perf("tp2-slow-rank", 2, tp2, "slow:*:60:1")
        rc, clean = (-1, failed) if failed else p.compare_perf("tp2")
        if rc != 0:
            out["slow rank"] = f"the clean TP2 run: exit {rc}: {clean}"
        else:
            out["slow rank"] = _named(*p.compare_perf("tp2-slow-rank"), "slow rank")
    finally:
        p.run.restore()
        if keep is None:
            shutil.rmtree(base, ignore_errors=True)
        else:
            log(f"  {tag}: logs and recordings in {work}")
    return out


def main(argv: list[str] | None = None) -> int:
    return tags_main(__doc__.split("\n")[0], run_tag, CHECKS, argv)


if __name__ == "__main__":
    sys.exit(main())
