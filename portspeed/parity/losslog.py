"""Loss records: read Megatron training logs and portspeed JSON loss records, write records.

A training script writes its record with ``open_loss_log`` (``PORTSPEED_LOSS_LOG`` or an explicit path).

A *loss record* is the one thing `portspeed compare` compares. It is a JSON file::

    {"meta": {"backend": "gloo", "accelerator": "cpu", "layout": {"tp": 2, "pp": 1, "dp": 1, "vpp": null},
              "dtype": "fp32", "versions": {"torch": "2.13.0", "megatron-core": "0.16.1"}},
     "iterations": [{"iteration": 1, "lm_loss": 10.83, "grad_norm": 4.21, "skipped": false}, ...]}

Non-finite values are written as the strings ``"nan"``, ``"inf"``, ``"-inf"`` so the file
stays strict JSON; a skipped iteration has ``"skipped": true`` and ``"lm_loss": null``.
Python's own ``NaN``/``Infinity`` tokens are accepted when reading.

Megatron logs are read from the lines Megatron-LM's ``training_log`` prints
(``iteration N/ M | ... | lm loss: X | loss scale: S | grad norm: G | ... |
number of skipped iterations: K | number of nan iterations: J |``) and from the simpler
``iteration N | lm loss: X | grad norm: Y`` line of portspeed's example trainer. Any text
before ``iteration`` (timestamps, ``[rank3]:`` prefixes) is ignored. Rules that follow from
how Megatron prints (see docs/compare.md):

* Megatron omits ``lm loss`` when the interval's average is not positive: all iterations of
  the interval were skipped (loss-scale overflow), or the loss is NaN (``nan > 0`` is
  false). A line with no ``lm loss`` and a non-zero skipped count is *skipped*; one with
  no ``lm loss`` and no skipped iteration is a *NaN* loss.
* Lines repeated with identical values (several ranks printing) collapse to one; the same
  iteration with different values (a resumed run appended to its log) keeps the *last*
  one, as that is what the resumed run computed.

Limits: with ``--log-interval`` > 1 each value is Megatron's average over the interval, and
is compared as such.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Mapping

from portspeed.errors import PortspeedError

__all__ = ["IterationLoss", "LossRecord", "LossLogError", "LossRecordWriter", "loss_record_meta", "open_loss_log",
           "parse_megatron_log", "read_record", "record_from_json", "write_record", "DTYPES", "normalize_dtype"]


class LossLogError(PortspeedError, ValueError):
    """A run's losses cannot be read: missing file, unknown format, no loss lines, bad record."""


#: canonical dtype names and the spellings accepted for them
DTYPES: dict[str, tuple[str, ...]] = {
    "fp32": ("fp32", "float32", "float", "torch.float32", "f32"),
    "bf16": ("bf16", "bfloat16", "torch.bfloat16"),
    "fp16": ("fp16", "float16", "half", "torch.float16", "f16"),
}


def normalize_dtype(name: str | None) -> str | None:
    """Map a dtype spelling ('bfloat16', 'torch.float32', ...) to 'fp32'/'bf16'/'fp16'; None stays None."""
    if name is None:
        return None
    low = str(name).strip().lower()
    for canon, spellings in DTYPES.items():
        if low in spellings:
            return canon
    raise LossLogError(
        f"unknown dtype {name!r}; use one of {', '.join(DTYPES)} (or bfloat16/float16/float32)"
    )


@dataclasses.dataclass
class IterationLoss:
    """One logged iteration. ``lm_loss`` is None only when the iteration was skipped."""

    iteration: int
    lm_loss: float | None
    grad_norm: float | None = None
    skipped: bool = False
    #: further fields seen in the log (loss scale, num zeros, params norm, other losses)
    extra: dict[str, float] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "iteration": self.iteration,
            "lm_loss": _encode_float(self.lm_loss),
            "grad_norm": _encode_float(self.grad_norm),
            "skipped": self.skipped,
        }
        for k, v in self.extra.items():
            d[k] = _encode_float(v)
        return d


@dataclasses.dataclass
class LossRecord:
    """The losses of one run plus what is known about how it ran (``meta``)."""

    iterations: list[IterationLoss]
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: where it was read from (file path), for messages
    source: str = "<memory>"

    @property
    def dtype(self) -> str | None:
        """The record's canonical dtype, or None when the meta does not say."""
        return normalize_dtype(self.meta.get("dtype")) if self.meta.get("dtype") else None

    @property
    def label(self) -> str:
        """A short name for tables: meta 'name' if present, else the file name."""
        return str(self.meta.get("name") or Path(self.source).name)

    def by_iteration(self) -> dict[int, IterationLoss]:
        return {it.iteration: it for it in self.iterations}

    def to_json(self) -> dict[str, Any]:
        return {"meta": self.meta, "iterations": [it.to_json() for it in self.iterations]}


# ----------------------------------------------------------------------------- floats

def _encode_float(x: float | None) -> float | str | None:
    if x is None:
        return None
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return float(x)


def _decode_float(x: Any, what: str, source: str) -> float | None:
    if x is None:
        return None
    if isinstance(x, bool):
        raise LossLogError(f"{source}: {what} is a boolean ({x!r}); expected a number, null or 'nan'")
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, str) and x.strip().lower() in ("nan", "inf", "+inf", "-inf", "infinity", "-infinity"):
        return float(x.strip().lower().replace("infinity", "inf"))
    raise LossLogError(f"{source}: {what} is {x!r}; expected a number, null, or one of 'nan', 'inf', '-inf'")


# ----------------------------------------------------------------------------- Megatron logs

# "iteration       10/     100 |" (stock) or "iteration 10 |" (example trainer)
_ITER = re.compile(r"\biteration\s+(\d+)\s*(?:/\s*(\d+))?\s*\|")
# " key: value |" fields; values like 1.083200E+01, 4.123, nan, 4294967296.0, 12
_FIELD = re.compile(r"\|?\s*([A-Za-z][A-Za-z0-9_ ()/\-.]*?):\s*"
                    r"([-+]?(?:[0-9.]+(?:[eE][-+]?\d+)?|nan|NAN|NaN|inf|INF|Inf))\s*(?=\||$)")

# evaluation lines (" validation loss at iteration 10 | lm loss value: ...") are not training losses
_EVAL = re.compile(r"\b(?:validation|test)\b[^|]*\bloss at\b")
_SKIPPED_KEY = "number of skipped iterations"
_NAN_KEY = "number of nan iterations"
#: fields that describe speed or bookkeeping, not the numerics: never kept in ``extra``
_IGNORED = re.compile(r"elapsed time|throughput|consumed samples|skipped samples|energy|power|learning rate|"
                      r"global batch size|iteration-time|tokens per sec")


def _field_name(key: str) -> str:
    if key == _SKIPPED_KEY:
        return "skipped_iterations"
    if key == _NAN_KEY:
        return "nan_iterations"
    return key.strip().lower().replace(" ", "_").replace("-", "_")


def parse_megatron_log(text: str, source: str = "<text>") -> LossRecord:
    """Parse Megatron-LM (or example-trainer) log text into a LossRecord.

    Raises LossLogError when no iteration line carries a loss, naming the source.
    """
    found: dict[int, IterationLoss] = {}
    train_iters: int | None = None
    for lineno, line in enumerate(text.splitlines(), 1):
        m = _ITER.search(line)
        if m is None or _EVAL.search(line):
            continue
        rest = line[m.end():]
        fields: dict[str, str] = {}
        for fm in _FIELD.finditer(rest):
            fields[fm.group(1).strip().lower()] = fm.group(2)
        losses = {k: v for k, v in fields.items() if k.endswith("loss") and k != "loss scale"}
        if not losses and _SKIPPED_KEY not in fields and "grad norm" not in fields:
            continue  # an "iteration N |" line of something else (e.g. a checkpoint message)
        iteration = int(m.group(1))
        if m.group(2):
            train_iters = int(m.group(2))
        skipped_count = int(float(fields.get(_SKIPPED_KEY, "0")))
        extra: dict[str, float] = {}
        for k, v in fields.items():
            if k in ("lm loss", "grad norm") or _IGNORED.search(k):
                continue
            extra[_field_name(k)] = float(v)
        lm = fields.get("lm loss")
        if lm is not None:
            entry = IterationLoss(iteration, float(lm), _opt_float(fields.get("grad norm")), False, extra)
        elif skipped_count > 0:
            entry = IterationLoss(iteration, None, _opt_float(fields.get("grad norm")), True, extra)
        else:
            # Megatron drops 'lm loss' when the average is not > 0: with nothing skipped, that is a NaN loss.
            entry = IterationLoss(iteration, math.nan, _opt_float(fields.get("grad norm")), False, extra)
        found[iteration] = entry  # last occurrence wins (resumed runs); identical repeats are harmless
    if not found:
        raise LossLogError(
            f"{source}: no loss lines found; expected Megatron lines like "
            "'iteration 10/ 100 | ... | lm loss: 1.0E+01 | ...' or 'iteration 10 | lm loss: 10.0 | grad norm: 1.0'. "
            "Is this the log of the last pipeline rank (Megatron prints losses there only)?"
        )
    meta: dict[str, Any] = {"format": "megatron-log"}
    if train_iters is not None:
        meta["train_iters"] = train_iters
    return LossRecord([found[k] for k in sorted(found)], meta, source)


def _opt_float(s: str | None) -> float | None:
    return None if s is None else float(s)


# ----------------------------------------------------------------------------- JSON records

def record_from_json(data: Any, source: str = "<json>") -> LossRecord:
    """Validate a decoded JSON loss record and build a LossRecord; errors name the bad field."""
    if not isinstance(data, Mapping) or "iterations" not in data:
        raise LossLogError(
            f"{source}: not a portspeed loss record (a JSON object with 'meta' and 'iterations'); "
            "see docs/compare.md for the format"
        )
    meta = data.get("meta") or {}
    if not isinstance(meta, Mapping):
        raise LossLogError(f"{source}: 'meta' must be a JSON object, got {type(meta).__name__}")
    items = data["iterations"]
    if not isinstance(items, list):
        raise LossLogError(f"{source}: 'iterations' must be a list, got {type(items).__name__}")
    if not items:
        raise LossLogError(f"{source}: 'iterations' is empty; the run logged no losses")
    out: dict[int, IterationLoss] = {}
    for i, item in enumerate(items):
        where = f"iterations[{i}]"
        if not isinstance(item, Mapping) or "iteration" not in item:
            raise LossLogError(f"{source}: {where} must be an object with an 'iteration' number")
        n = item["iteration"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise LossLogError(f"{source}: {where}.iteration is {n!r}; expected a non-negative integer")
        skipped = item.get("skipped", False)
        if not isinstance(skipped, bool):
            raise LossLogError(f"{source}: {where}.skipped is {skipped!r}; expected true or false")
        lm = _decode_float(item.get("lm_loss"), f"{where}.lm_loss", source)
        if lm is None and not skipped:
            raise LossLogError(
                f"{source}: {where} (iteration {n}) has no lm_loss but is not marked skipped; "
                "write \"lm_loss\": \"nan\" for a NaN loss or \"skipped\": true for a skipped step"
            )
        if n in out:
            raise LossLogError(f"{source}: iteration {n} appears twice in 'iterations'")
        gn = _decode_float(item.get("grad_norm"), f"{where}.grad_norm", source)
        extra = {}
        for k, v in item.items():
            if k not in ("iteration", "lm_loss", "grad_norm", "skipped") and (
                    isinstance(v, (int, float, str)) and not isinstance(v, bool)):
                try:
                    extra[k] = _decode_float(v, f"{where}.{k}", source)
                except LossLogError:
                    continue  # non-numeric annotations are allowed and not compared
        out[n] = IterationLoss(n, lm, gn, skipped, {k: v for k, v in extra.items() if v is not None})
    if meta.get("dtype") is not None:
        normalize_dtype(meta["dtype"])  # fail early on an unknown dtype
    return LossRecord([out[k] for k in sorted(out)], dict(meta), source)


def read_record(path: str | os.PathLike[str]) -> LossRecord:
    """Read a loss record or a Megatron log, deciding by content (JSON object or not).

    A JSON run spec (with 'runs') is not a record: `portspeed.parity.runspec` launches those.
    """
    p = Path(path)
    if not p.exists():
        raise LossLogError(f"{p}: no such file; give a Megatron log, a JSON loss record or a JSON run spec")
    if p.is_dir():
        raise LossLogError(f"{p}: is a directory; give a Megatron log file or a JSON loss record")
    try:
        text = p.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise LossLogError(f"{p}: cannot be read ({e})") from e
    if "\x00" in text[:4096]:
        raise LossLogError(
            f"{p}: unknown format (a binary file); give a Megatron log, a JSON loss record or a JSON run spec")
    stripped = text.lstrip()
    if stripped.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise LossLogError(f"{p}: looks like JSON but does not parse ({e}); fix the file or pass the log") from e
        if isinstance(data, Mapping) and ("runs" in data or "matrix" in data) and "iterations" not in data:
            raise LossLogError(f"{p}: is a run spec, not a loss record; launch it with `portspeed compare {p}`")
        return record_from_json(data, str(p))
    if not stripped:
        raise LossLogError(f"{p}: is empty; no loss lines found")
    return parse_megatron_log(text, str(p))


def write_record(record: LossRecord | Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write a loss record as strict JSON, atomically (a reader never sees half a file)."""
    data = record.to_json() if isinstance(record, LossRecord) else dict(record)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=p.name + ".", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, allow_nan=False)
            f.write("\n")
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p


class LossRecordWriter:
    """Collects iterations during training and rewrites the record file after each one.

    Rewriting on every ``add`` means a crashed run still leaves the iterations it reached.
    Call it on the rank that knows the loss (the last pipeline stage)::

        w = LossRecordWriter(path, meta={"backend": "gloo", "dtype": "fp32",
                                         "layout": {"tp": 2, "pp": 1, "dp": 1, "vpp": None}})
        w.add(it, loss, grad_norm)           # per iteration
    """

    def __init__(self, path: str | os.PathLike[str], meta: Mapping[str, Any] | None = None,
                 every: int = 1) -> None:
        if every < 1:
            raise LossLogError(f"LossRecordWriter(every={every}): must be >= 1 (write every N iterations)")
        self.path = Path(path)
        self.record = LossRecord([], dict(meta or {}), str(self.path))
        if self.record.meta.get("dtype") is not None:
            self.record.meta["dtype"] = normalize_dtype(self.record.meta["dtype"])
        self._every = every

    def add(self, iteration: int, lm_loss: float | None, grad_norm: float | None = None,
            skipped: bool = False, **extra: float) -> None:
        """Append one iteration (floats, or 0-d tensors: anything ``float()`` accepts)."""
        lm = None if lm_loss is None else float(lm_loss)
        if lm is None and not skipped:
            raise LossLogError(f"iteration {iteration}: lm_loss is None but skipped is False; pass skipped=True")
        self.record.iterations.append(IterationLoss(
            int(iteration), lm, None if grad_norm is None else float(grad_norm), bool(skipped),
            {k: float(v) for k, v in extra.items()}))
        if len(self.record.iterations) % self._every == 0:
            self.flush()

    def flush(self) -> Path:
        """Write what has been collected so far."""
        return write_record(self.record, self.path)


def loss_record_meta(layout: Mapping[str, Any], dtype: str, *, backend: str, accelerator: str) -> dict[str, Any]:
    """The ``meta`` block of a loss record: the adapter and backend the caller names, this process's versions."""
    from portspeed.versions import distribution_version

    versions = {}
    for d in ("torch", "megatron-core", "portspeed"):
        v = distribution_version(d)
        versions[d] = None if v is None else str(v)
    return {
        "backend": backend,
        "accelerator": accelerator,
        "layout": {k: (None if layout.get(k) is None else int(layout[k])) for k in ("tp", "pp", "dp", "vpp")},
        "dtype": dtype,
        "versions": versions,
    }


def open_loss_log(path: str | None, layout: Mapping[str, Any], dtype: str, *, backend: str,
                  accelerator: str) -> LossRecordWriter | None:
    """A writer for ``path`` (or PORTSPEED_LOSS_LOG) whose meta names ``backend`` and ``accelerator``; None when
    neither path is set. A training script calls it on the rank that reports the loss::

        writer = open_loss_log(args.loss_log, {"tp": 2, "pp": 1, "dp": 2, "vpp": None}, "bf16",
                               backend=dist.get_backend(), accelerator=portspeed.get_accelerator().name)
    """
    from portspeed import config

    path = path or config.settings().loss_log
    if not path:
        return None
    return LossRecordWriter(path, meta=loss_record_meta(layout, dtype, backend=backend, accelerator=accelerator))
