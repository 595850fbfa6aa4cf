"""What a new user reads: the router-rewrite sentence, the demo's split of framework noise from portspeed's words,
and `portspeed run`'s closing line about which rank died and why."""

from __future__ import annotations

import importlib.util
import signal
from pathlib import Path

import pytest

from helpers.launch import REPO

from portspeed.cli.failures import Failure, summary_line
from portspeed.comm import explain


def _demo():
    spec = importlib.util.spec_from_file_location("portspeed_demo", REPO / "examples" / "demo.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def test_router_rewrites_read_as_a_sentence() -> None:
    assert explain({}) == "router rewrites: none needed (the backend ran every collective as requested)"
    text = explain({"reduce_scatter_tensor": {"rewrites": 3, "by": {"avg_as_sum": 2, "upcast": 1}}})
    assert text.startswith("router rewrites: the backend lacked some collectives; ")
    assert "reduce_scatter_tensor x2: AVG ran as SUM, then a division by the group size" in text
    assert "reduce_scatter_tensor x1: the dtype was upcast" in text


def test_demo_keeps_framework_noise_off_the_screen(tmp_path: Path) -> None:
    """Megatron's warnings and torchrun's banners go to the log and are counted; portspeed's own lines do not."""
    noise = _demo().Noise(tmp_path / "w.log")
    lines = [
        "/x/site-packages/megatron/core/optimizer/__init__.py:24: UserWarning: Transformer Engine and Apex are not "
        "installed. Falling back to Torch optimizers.",
        "  warnings.warn(",
        "W1125 04:06:07.096000 15821 torch/distributed/run.py:874] *****",
        "/x/site-packages/torch/foo.py:3: FutureWarning: something is deprecated",
    ]
    mine = ["/work/portspeed/patches/x.py:9: UserWarning: portspeed says so",
            "portspeed: gradient-accumulation fusion needs CUDA; the torch path runs",
            "router rewrites: none needed (the backend ran every collective as requested)",
            "iteration 1 | lm loss: 4.85 | grad norm: 1.5"]
    assert [noise.take(ln) for ln in lines] == [True, True, True, True]
    assert [noise.take(ln) for ln in mine] == [False, False, False, False]
    noise.close()
    assert noise.lines == 4 and len(noise.kinds) == 2
    assert (tmp_path / "w.log").read_text().splitlines() == lines


def test_last_line_names_the_dead_rank() -> None:
    died = Failure(attempt=0, rank=1, local_rank=1, exitcode=17, host="h")
    assert summary_line([died], ok=True) == (
        "portspeed run: finished after 1 restart (attempt 1: rank 1 (local rank 1 on h) exit code 17)")
    killed = Failure(attempt=1, rank=0, local_rank=0, exitcode=-signal.SIGKILL, host="h")
    assert summary_line([died, killed], ok=False) == (
        "portspeed run: failed, no restarts left (attempt 1: rank 1 (local rank 1 on h) exit code 17; "
        "attempt 2: rank 0 (local rank 0 on h) killed by SIGKILL)")


@pytest.mark.parametrize("argv", [["--iters", "0"], ["--layouts", "tp3"]])
def test_demo_refuses_bad_arguments(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _demo().main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and ("--iters 0" in err or "'tp3'" in err), err
