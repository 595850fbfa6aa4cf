"""``portspeed precheck DIR``: a wrong vendor kernel named from one op-level dump, with no golden run.

Real runs of the example trainer (megatron-core on CPU, the C++ test device, Megatron's Transformer
Engine spec served by the portable TE, RMSNorm, TP1, iteration 1 probed at op level with the
kernels' full tensors saved: ``--probe-tensors 'Kernel.*'``); no CPU training run anywhere:

- the test device whose vendor ``rms_norm`` is off by 1e-3 relative (tests/data/testdev_rms_off.py):
  precheck lists ``rms_norm`` first, and only ``rms_norm``, error 1e-3 against the fp32 band 1e-4,
  exit 1; from the saved tensors (the device's recorded output against the float64 replay) and
  from inputs drawn from the statistics (the vendor kernel run again on the device);
- the clean test device: exit 0 in both input modes, and the probed run's losses equal the unprobed
  run's bit for bit (the kernels' recording wrapper only observes);
- bad input, one line on stderr, exit 2: no dump, a module-level dump, nothing replayable, the dump
  of another adapter replayed from statistics.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from helpers.requires import require

require("megatron.core", "pip install 'portspeed[megatron]'")

from helpers.launch import Result, free_port, parse_losses, run_python, torchrun  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.megatron, pytest.mark.testdev]

SCRIPT = "examples/pretrain_gpt.py"
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--vocab-size", "64", "--global-batch-size", "4", "--micro-batch-size", "2", "--lr", "1e-3",
         "--seed", "1234", "--iters", "1", "--transformer-impl", "transformer_engine", "--normalization", "RMSNorm"]
RMS_OFF = "tests/data/testdev_rms_off.py:TestdevRmsOff"
TIMEOUT = 300


def probed_run(out: Path, adapter: str) -> dict:
    """``portspeed run --probe out --probe-level op`` on ``adapter``: its losses."""
    for attempt in range(2):
        res = run_python(["-m", "portspeed.cli", "run", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
                          "--master-port", str(free_port()), "--probe", str(out), "--probe-level", "op",
                          "--probe-tensors", "Kernel.*", SCRIPT, *MODEL], timeout=TIMEOUT, drop=("PORTSPEED_*",),
                         env={"PORTSPEED_ACCELERATOR": adapter})
        if not (res.returncode != 0 and "EADDRINUSE" in res.stderr and attempt == 0):
            break
        shutil.rmtree(out, ignore_errors=True)
    return parse_losses(res.check().stdout)


def precheck(folder: Path, adapter: str | None, *args: str) -> Result:
    env = {"PORTSPEED_ACCELERATOR": adapter} if adapter else {}
    return run_python(["-m", "portspeed.cli", "precheck", str(folder), *args], timeout=TIMEOUT,
                      drop=("PORTSPEED_*",), env=env)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Op-level dumps of iteration 1 on the planted and on the clean test device; the clean run's losses checked
    against an unprobed run."""
    root = tmp_path_factory.mktemp("precheck")
    off, clean = root / "rms_off", root / "clean"
    probed_run(off, RMS_OFF)
    got = probed_run(clean, "testdev")
    plain = parse_losses(torchrun(SCRIPT, 1, MODEL, timeout=TIMEOUT,
                                  env={"PORTSPEED_ACCELERATOR": "testdev", "PORTSPEED_PROBE_DIR": ""}).check().stdout)
    assert got == plain and sorted(got) == [1], f"op-level probing changed the TE run: {got} vs {plain}"
    return {"off": off, "clean": clean}


@pytest.mark.parametrize("inputs", ["auto", "statistics"])
def test_a_vendor_rms_norm_off_by_1e3_is_named_first(dumps: dict[str, Path], inputs: str) -> None:
    """rms_norm first and alone, its error the planted 1e-3, exit 1; auto takes the kernels' saved tensors."""
    res = precheck(dumps["off"], RMS_OFF, "--inputs", inputs, "--show", "0")
    assert res.returncode == 1, f"exit {res.returncode}\n{res.stdout}\n{res.stderr[-2000:]}"
    lines = res.stdout.strip().splitlines()
    used = "tensors" if inputs == "auto" else "statistics"
    first = re.match(r"^rms_norm  Kernel\.rms_norm\.\d+\.forward  in decoder\.layers\.[01]\.\S+ \(iteration 1, "
                     rf"rank 0, vendor kernel; inputs: {used}\): case \(float32\[16, 2, 32\], float32\[32\], 1e-05\) "
                     r"-> float32\[16, 2, 32\]: error (\S+) > band 0\.0001$", lines[0])
    assert first, lines[0]
    assert 9e-4 <= float(first[1]) <= 1.1e-3, first[1]
    # 2 norms x 2 layers x 2 micro-batches, every one of them, and nothing else
    assert len(lines) == 9 and all(ln.startswith("rms_norm  Kernel.rms_norm.") and f"inputs: {used})" in ln
                                   for ln in lines[:8]), lines
    assert re.match(r"^precheck: 8 of \d+ replayed ops outside their band \(rms_norm 8; worst Kernel\.rms_norm\.",
                    lines[-1]), lines[-1]
    assert "from statistics, run on testdev:0" in lines[-1]  # the ops with no saved tensors, in auto too


@pytest.mark.parametrize("inputs", ["auto", "statistics"])
def test_the_clean_test_device_passes(dumps: dict[str, Path], inputs: str) -> None:
    """Every replayed op of the clean device within its band, in both input modes: exit 0."""
    res = precheck(dumps["clean"], "testdev", "--inputs", inputs)
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout}\n{res.stderr[-2000:]}"
    summary = res.stdout.strip().splitlines()
    assert len(summary) == 1 and summary[0].startswith("precheck: all "), summary
    assert "from statistics, run on testdev:0" in summary[0]


def test_bad_input_is_one_line_and_exit_2(dumps: dict[str, Path], tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """No dump, a module-level dump, nothing replayable (here, in-process), another adapter's dump replayed from
    statistics (on that device): one line on stderr, exit 2."""
    from portspeed.probe.cli.precheck import main

    module = tmp_path / "module"
    shutil.copytree(dumps["clean"], module)
    dump_json = module / "step1" / "rank0" / "dump.json"
    doc = json.loads(dump_json.read_text())
    doc["level"], doc["portspeed"]["level"] = "L0", "module"
    dump_json.write_text(json.dumps(doc))
    cases = [([str(tmp_path / "none")], "no such folder"),
             ([str(module)], "a module-level dump (--probe-level module)"),
             ([str(dumps["clean"]), "--ops", "Distributed.*"], "nothing replayable among its 7 op entries (a "
                                                              "collective: 7) matching --ops Distributed.*")]
    for args, said in cases:
        code = main(args)
        out, err = capsys.readouterr()
        assert code == 2 and not out and len(err.splitlines()) == 1 and said in err, (code, out, err)
    res = precheck(dumps["off"], "testdev", "--inputs", "statistics")
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("portspeed precheck: ")]
    assert res.returncode == 2 and len(lines) == 1 and not res.stdout, (res.returncode, res.stdout, res.stderr[-2000:])
    assert "recorded on adapter 'testdev_rms_off', this process runs 'testdev'" in lines[0], lines[0]
