"""portspeed.parity.pytest_plugin: fixtures exercised inside throw-away pytest sessions (pytester)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

DATA = Path(__file__).parent / "data"
TRAIN = str(DATA / "tiny_ddp_train.py")


def record(values: list[float], dtype: str = "fp32", backend: str = "gloo") -> str:
    return json.dumps({"meta": {"dtype": dtype, "backend": backend},
                       "iterations": [{"iteration": i, "lm_loss": v, "grad_norm": 1.0, "skipped": False}
                                      for i, v in enumerate(values, 1)]})


def test_plugin_is_registered_by_entry_point(pytester):
    """The installed pytest11 entry point provides the fixtures and the --update-golden option."""
    result = pytester.runpytest("--fixtures")
    for fixture in ("portspeed_launch", "assert_losses_match", "loss_golden"):  # in any order
        result.stdout.fnmatch_lines([f"*{fixture}*"])
    result = pytester.runpytest("--help")
    result.stdout.fnmatch_lines(["*--update-golden*"])


def test_assert_losses_match_passes_and_catches_planted_mismatch(pytester):
    """Equal records pass; a record shifted by 1e-3 at iteration 3 fails with the divergence in the message."""
    pytester.makefile(".json", ref=record([10.0, 9.5, 9.0, 8.7]),
                      same=record([10.0, 9.5 + 1e-7, 9.0, 8.7]),
                      off=record([10.0, 9.5, 9.001, 8.701]))
    pytester.makepyfile("""
        def test_same(assert_losses_match):
            c = assert_losses_match("same.json", "ref.json")
            assert c.ok

        def test_planted(assert_losses_match):
            assert_losses_match("off.json", "ref.json")

        def test_planted_within_loose_tolerance(assert_losses_match):
            assert_losses_match("off.json", "ref.json", atol=2e-3)
    """)
    result = pytester.runpytest()
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*DIVERGED at iteration 3*", "FAILED*::test_planted*"])


def test_loss_golden_missing_update_then_compare(pytester):
    """No golden: fail asking for --update-golden; --update-golden writes it; then it compares, and catches a change."""
    pytester.makefile(".json", run=record([10.0, 9.0, 8.0], backend="gloo"))
    pytester.makepyfile(test_golden="""
        def test_golden(loss_golden):
            loss_golden("run.json", "golden/tiny.{backend}.json")
    """)
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*golden loss file*tiny.gloo.json does not exist*--update-golden*"])

    result = pytester.runpytest("--update-golden")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*portspeed: rewrote 1 golden loss file*", "*golden/tiny.gloo.json"])
    golden = pytester.path / "golden" / "tiny.gloo.json"
    assert json.loads(golden.read_text())["iterations"][2]["lm_loss"] == 8.0

    pytester.runpytest().assert_outcomes(passed=1)
    (pytester.path / "run.json").write_text(record([10.0, 9.0, 8.01], backend="gloo"))
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*golden file*tiny.gloo.json (rewrite with --update-golden)*",
                                 "*DIVERGED at iteration 3*"])


def test_loss_golden_placeholder_missing_from_meta(pytester):
    """A golden path naming a meta field the record lacks is a usage error naming the field."""
    pytester.makefile(".json", run=json.dumps({"meta": {}, "iterations": [{"iteration": 1, "lm_loss": 1.0}]}))
    pytester.makepyfile("""
        def test_golden(loss_golden):
            loss_golden("run.json", "golden/{accelerator}.json")
    """)
    result = pytester.runpytest()
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*uses {accelerator} but the record's meta has no 'accelerator'*"])


@pytest.mark.multiproc
def test_portspeed_launch_real_runs(pytester):
    """Real launches: a 2-rank run (via `portspeed run`) matches a single process; a perturbed run and a
    crashing 2-rank torchrun run fail, the crash with the rank's own message."""
    pytester.makepyfile(f"""
        TRAIN = {TRAIN!r}

        def test_dp2_matches_single(portspeed_launch, assert_losses_match):
            single = portspeed_launch(TRAIN, "--iters", "5", nproc=None, timeout=120)
            # through `portspeed run` (the adaptor-importing launcher), with no adaptor: a plain 2-rank run
            dp2 = portspeed_launch(TRAIN, "--iters", "5", "--loss-log", "{{record}}", nproc=2, timeout=120,
                                   adaptor="none")
            assert dp2.meta["layout"]["dp"] == 2 and len(dp2.iterations) == 5
            assert_losses_match(dp2, single)

        def test_perturbed_fails(portspeed_launch, assert_losses_match):
            ref = portspeed_launch(TRAIN, "--iters", "5", nproc=None, timeout=120)
            bad = portspeed_launch(TRAIN, "--iters", "5", "--perturb-at", "2", nproc=None, timeout=120)
            assert_losses_match(bad, ref)

        def test_crash_shows_log(portspeed_launch):
            portspeed_launch(TRAIN, "--iters", "5", "--crash-at", "2", nproc=2, timeout=120)
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=400)
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(["*DIVERGED at iteration 3*"])
    result.stdout.fnmatch_lines(["*portspeed_launch: run tiny_ddp_train-1: exited with status*",
                                 "*crashing on purpose at iteration 2*", "*logs kept in*"])
