"""portspeed.parity.losslog: Megatron log text and JSON loss records in, loss records out."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from portspeed.parity.losslog import (
    LossLogError,
    LossRecord,
    LossRecordWriter,
    normalize_dtype,
    open_loss_log,
    parse_megatron_log,
    read_record,
    record_from_json,
    write_record,
)

DATA = Path(__file__).parent / "data"


def _printed_losses(path: Path) -> dict[int, float]:
    """The 'lm loss' values as printed in a stock log, read with a plain regex (independent of the parser)."""
    out = {}
    for line in path.read_text().splitlines():
        m = re.search(r"iteration\s+(\d+)/\s*\d+ \|.*\| lm loss: (\S+) \|", line)
        if m:
            out[int(m.group(1))] = float(m.group(2))
    return out


def test_stock_fp32_log_gives_every_printed_iteration():
    """Each training line becomes one iteration with the printed lm loss and grad norm; other lines are ignored."""
    path = DATA / "megatron_fp32_tp1.log"
    rec = read_record(path)
    printed = _printed_losses(path)
    assert [it.iteration for it in rec.iterations] == sorted(printed) == list(range(1, 21))
    assert {it.iteration: it.lm_loss for it in rec.iterations} == printed
    assert rec.meta["train_iters"] == 20
    assert rec.iterations[0].grad_norm == 6.275
    assert rec.iterations[0].extra["loss_scale"] == 1.0
    assert all(not it.skipped for it in rec.iterations)
    # the validation line at iteration 10 holds 'lm loss value', which must not replace the training loss
    assert rec.by_iteration()[10].lm_loss == printed[10]


def test_timing_fields_are_not_kept():
    """Speed and bookkeeping fields (elapsed time, learning rate, consumed samples) are not numerics to compare."""
    it = read_record(DATA / "megatron_fp32_tp1.log").iterations[3]
    assert not any(("elapsed" in k or "learning" in k or "consumed" in k or "batch" in k) for k in it.extra)


def test_bf16_nan_iterations_are_nan_not_skipped():
    """bf16, a NaN loss: Megatron prints no 'lm loss' (nan > 0 is false), 'grad norm: nan'; that is NaN, not a skip."""
    rec = read_record(DATA / "megatron_bf16_nan.log")
    by = rec.by_iteration()
    for n in range(1, 15):
        assert math.isfinite(by[n].lm_loss) and not by[n].skipped
    for n in range(15, 21):
        assert math.isnan(by[n].lm_loss), n
        assert not by[n].skipped
        assert math.isnan(by[n].grad_norm)
    assert by[1].extra["num_zeros"] == 12.0
    assert by[2].extra["num_zeros"] == 0.0
    assert "params_norm" in by[3].extra


def test_fp16_overflow_iterations_are_skipped_with_loss_scale():
    """fp16 loss-scale overflows print no loss and a skipped count of 1: skipped iterations with no lm_loss."""
    rec = read_record(DATA / "megatron_fp16_skipped.log")
    by = rec.by_iteration()
    skipped = [n for n, it in by.items() if it.skipped]
    assert skipped == [1, 2, 3, 9]
    assert all(by[n].lm_loss is None and by[n].grad_norm is None for n in skipped)
    assert by[2].extra["loss_scale"] == by[1].extra["loss_scale"] / 2
    assert by[9].extra["nan_iterations"] == 1.0
    assert by[4].lm_loss is not None and by[4].extra["skipped_iterations"] == 0.0


def test_log_interval_lines_are_interval_averages():
    """With --log-interval 5 only every fifth iteration is logged; those are what the record holds."""
    rec = read_record(DATA / "megatron_fp32_interval5.log")
    assert [it.iteration for it in rec.iterations] == [5, 10, 15, 20]


def test_resumed_log_keeps_the_last_occurrence():
    """A run resumed from a checkpoint logs iterations 6-8 again; the resumed values are the ones kept."""
    path = DATA / "megatron_fp32_resumed.log"
    lines = [ln for ln in path.read_text().splitlines() if re.search(r"iteration\s+6/", ln)]
    assert len(lines) == 2
    last = float(re.search(r"lm loss: (\S+) \|", lines[-1]).group(1))
    first = float(re.search(r"lm loss: (\S+) \|", lines[0]).group(1))
    assert first != last
    rec = read_record(path)
    assert rec.by_iteration()[6].lm_loss == last
    assert [it.iteration for it in rec.iterations] == list(range(1, 11))


def test_example_trainer_lines_keep_full_precision():
    """'iteration N | lm loss: X | grad norm: Y' from the example trainer round-trips the printed repr exactly."""
    path = DATA / "example_tp1.log"
    rec = read_record(path)
    expected = {int(m.group(1)): float(m.group(2))
                for m in re.finditer(r"^iteration (\d+) \| lm loss: (\S+) \|", path.read_text(), re.M)}
    assert len(expected) == 12
    assert {it.iteration: it.lm_loss for it in rec.iterations} == expected
    assert "train_iters" not in rec.meta


def test_rank_prefixes_and_uppercase_nan_are_understood():
    """Launcher prefixes ('[rank3]: ', '[default0]:') are ignored; NAN/inf spellings parse as floats."""
    text = ("[rank3]: iteration        1/       2 | lm loss: 1.000000E+01 | grad norm: 3.000 |\n"
            "[default0]: iteration        2/       2 | lm loss: NAN | grad norm: inf |\n")
    rec = parse_megatron_log(text, "inline")
    assert rec.iterations[0].lm_loss == 10.0
    assert math.isnan(rec.iterations[1].lm_loss) and rec.iterations[1].grad_norm == math.inf


def test_non_loss_iteration_lines_are_ignored():
    """Checkpoint messages that mention an iteration are not loss lines."""
    text = "  successfully saved checkpoint from iteration      10 to /ckpt [ t 1/1, p 1/1 ]\n"
    with pytest.raises(LossLogError, match="no loss lines"):
        parse_megatron_log(text, "ckpt.log")


@pytest.mark.parametrize("content, match", [
    ("", "is empty"),
    ("hello\nworld\n", "no loss lines"),
    ("{not json", "does not parse"),
    ('{"a": 1}', "not a portspeed loss record"),
    ('{"runs": [], "timeout": 5}', "is a run spec"),
    ('{"iterations": []}', "is empty"),
])
def test_bad_inputs_name_the_problem(tmp_path, content, match):
    """Each unreadable input raises LossLogError naming the file and what is wrong."""
    p = tmp_path / "run.txt"
    p.write_text(content)
    with pytest.raises(LossLogError, match=match) as ei:
        read_record(p)
    assert str(p) in str(ei.value)


def test_binary_file_is_unknown_format(tmp_path):
    """A binary file (a PNG given by mistake) is an unknown format, not a log without losses."""
    p = tmp_path / "curves.png"
    p.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    with pytest.raises(LossLogError, match="unknown format"):
        read_record(p)


def test_missing_file_and_directory(tmp_path):
    """A missing path and a directory are refused with what to give instead."""
    with pytest.raises(LossLogError, match="no such file"):
        read_record(tmp_path / "nope.log")
    with pytest.raises(LossLogError, match="is a directory"):
        read_record(tmp_path)


@pytest.mark.parametrize("item, match", [
    ({"iteration": 1}, "not marked skipped"),
    ({"iteration": -1, "lm_loss": 1.0}, "non-negative integer"),
    ({"iteration": 1.5, "lm_loss": 1.0}, "non-negative integer"),
    ({"iteration": 1, "lm_loss": "abc"}, "expected a number"),
    ({"iteration": 1, "lm_loss": True}, "boolean"),
    ({"iteration": 1, "lm_loss": 1.0, "skipped": "no"}, "true or false"),
])
def test_record_validation(item, match):
    """Malformed iteration entries are rejected with the field named."""
    with pytest.raises(LossLogError, match=match):
        record_from_json({"meta": {}, "iterations": [item]}, "r.json")


def test_record_duplicate_iteration_and_bad_dtype():
    """A record cannot hold an iteration twice or declare an unknown dtype."""
    with pytest.raises(LossLogError, match="appears twice"):
        record_from_json({"iterations": [{"iteration": 1, "lm_loss": 1.0}, {"iteration": 1, "lm_loss": 2.0}]})
    with pytest.raises(LossLogError, match="unknown dtype 'int3'"):
        record_from_json({"meta": {"dtype": "int3"}, "iterations": [{"iteration": 1, "lm_loss": 1.0}]})


def test_record_round_trip_is_strict_json(tmp_path):
    """NaN, inf and skipped iterations survive write/read, and the file has no NaN/Infinity tokens."""
    rec = record_from_json({
        "meta": {"backend": "gloo", "dtype": "bfloat16", "layout": {"tp": 2, "pp": 1, "dp": 1, "vpp": None}},
        "iterations": [
            {"iteration": 1, "lm_loss": 10.5, "grad_norm": 3.25, "skipped": False},
            {"iteration": 2, "lm_loss": None, "grad_norm": None, "skipped": True},
            {"iteration": 3, "lm_loss": "nan", "grad_norm": "inf"},
            {"iteration": 4, "lm_loss": float("nan"), "loss_scale": 1.0, "note": "free text"},
        ]}, "in-memory")
    p = write_record(rec, tmp_path / "sub" / "r.json")

    def refuse(tok):
        raise AssertionError(f"non-strict JSON token {tok}")

    json.loads(p.read_text(), parse_constant=refuse)
    back = read_record(p)
    assert back.dtype == "bf16"
    assert back.meta["layout"]["tp"] == 2
    it = back.by_iteration()
    assert it[1].lm_loss == 10.5 and it[1].grad_norm == 3.25
    assert it[2].skipped and it[2].lm_loss is None
    assert math.isnan(it[3].lm_loss) and it[3].grad_norm == math.inf
    assert math.isnan(it[4].lm_loss) and it[4].extra == {"loss_scale": 1.0}


def test_writer_rewrites_after_each_iteration(tmp_path):
    """A crashed run leaves every iteration it reached: the file is complete after each add()."""
    p = tmp_path / "loss.json"
    w = LossRecordWriter(p, meta={"dtype": "float32", "backend": "gloo"})
    w.add(1, 10.0, 2.0)
    assert [it.iteration for it in read_record(p).iterations] == [1]
    w.add(2, None, None, skipped=True, loss_scale=2.0 ** 16)
    back = read_record(p)
    assert back.dtype == "fp32" and back.meta["dtype"] == "fp32"
    assert back.by_iteration()[2].skipped and back.by_iteration()[2].extra["loss_scale"] == 65536.0
    with pytest.raises(LossLogError, match="skipped=True"):
        w.add(3, None)
    with pytest.raises(LossLogError, match="every=0"):
        LossRecordWriter(p, every=0)


@pytest.mark.parametrize("spelling, canon", [("bfloat16", "bf16"), ("torch.float32", "fp32"), ("half", "fp16"),
                                             ("BF16", "bf16"), (None, None)])
def test_normalize_dtype(spelling, canon):
    """Common dtype spellings map to fp32/bf16/fp16."""
    assert normalize_dtype(spelling) == canon


def test_label_prefers_meta_name():
    """Tables name a run by meta.name, else by its file name."""
    assert LossRecord([], {"name": "tp2"}, "/x/y.json").label == "tp2"
    assert LossRecord([], {}, "/x/y.json").label == "y.json"


def test_real_stock_megatron_cpu_log():
    """A real log of stock Megatron-LM core_v0.16.1 pretrain_gpt.py (CPU, through portspeed): all 10 iterations,
    none lost among warnings, the argument dump and timers."""
    path = DATA / "megatron_stock_cpu_tp2.real.log"
    rec = read_record(path)
    printed = _printed_losses(path)
    assert len(printed) == 10
    assert {it.iteration: it.lm_loss for it in rec.iterations} == printed
    assert rec.meta["train_iters"] == 10
    assert all(it.grad_norm is not None and not it.skipped for it in rec.iterations)


def test_open_loss_log_names_what_the_script_says_ran(tmp_path: Path) -> None:
    """open_loss_log writes the layout, the backend and adapter the script names, and this process's versions."""
    w = open_loss_log(str(tmp_path / "rec.json"), {"tp": 2, "pp": 1, "dp": 2, "vpp": None}, "fp32",
                      backend="gloo", accelerator="cpu")
    assert w is not None
    w.add(1, 4.5, 1.25)
    rec = json.loads((tmp_path / "rec.json").read_text())
    assert rec["meta"]["layout"] == {"tp": 2, "pp": 1, "dp": 2, "vpp": None}, rec
    assert rec["meta"]["backend"] == "gloo" and rec["meta"]["accelerator"] == "cpu"
    assert rec["meta"]["versions"]["megatron-core"] and rec["meta"]["versions"]["torch"]
    assert rec["iterations"][0]["lm_loss"] == 4.5 and rec["iterations"][0]["grad_norm"] == 1.25


def test_open_loss_log_without_a_path_writes_nothing(portspeed_env) -> None:
    """No path and no PORTSPEED_LOSS_LOG: no writer."""
    portspeed_env()
    assert open_loss_log(None, {"tp": 1}, "fp32", backend="gloo", accelerator="cpu") is None
