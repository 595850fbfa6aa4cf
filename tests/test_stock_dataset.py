"""Stock ``pretrain_gpt.py`` on a real dataset: English text, a SentencePiece tokenizer trained here, TP2 = TP1.

No download at any point (``HF_HUB_OFFLINE=1``): the corpus is the docstrings of Python's
own standard library (real English prose that ships with every Python), the tokenizer is a
500-piece BPE model trained on it in the test with ``sentencepiece`` (the ``stock`` extra),
and the checkout's ``tools/preprocess_data.py`` turns the corpus into an indexed dataset with
``--tokenizer-type GPTSentencePieceTokenizer`` (end of document = the model's ``</s>``).
Then, through the documented example (``examples/stock/pretrain_gpt_cpu.sh`` with
``DATA_PATH``), a TP1 process trains 3 iterations and saves, and TP1 and TP2 fine-tune 10
iterations from it; TP2 must equal TP1 within 1e-5 per iteration (fp32, the same sums in
another order). ``--make-vocab-size-divisible-by 256`` pads the 500 pieces to 512 for TP1
and TP2 alike, so both train the same model.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import random
import struct
import sys
import warnings
from pathlib import Path

import pytest
from helpers.launch import free_port, run_command, run_python
from helpers.requires import require
from helpers.stock import SKIP_REASON, require_stock_packages
from helpers.stock_parity import max_diff, venv_python_first

from portspeed.parity.losslog import parse_megatron_log

pytestmark = [pytest.mark.megatron, pytest.mark.stock, pytest.mark.multiproc,
              pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")]

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "stock" / "pretrain_gpt_cpu.sh"
TOLERANCE = 1e-5
VOCAB = 500
ITERS = 10
TIMEOUT = 600
TOKENIZER = ["--tokenizer-type", "GPTSentencePieceTokenizer", "--make-vocab-size-divisible-by", "256"]
#: standard-library modules whose docstrings are the corpus (prose, present in every CPython)
MODULES = ("argparse", "collections", "functools", "itertools", "json", "logging", "os", "pathlib", "re",
           "string", "subprocess", "textwrap", "threading", "typing", "unittest", "urllib.parse", "email.message",
           "http.client", "inspect", "random", "statistics", "datetime", "decimal", "fractions", "heapq", "shutil",
           "tempfile", "zipfile", "csv", "difflib")


def write_corpus(path: Path) -> int:
    """One JSON line per docstring of MODULES and their public members; returns the number of documents."""
    docs: list[str] = []
    with warnings.catch_warnings():  # typing.io / typing.re warn that they are deprecated when read
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in MODULES:
            mod = importlib.import_module(name)
            for obj in [mod, *(getattr(mod, a) for a in sorted(vars(mod)) if not a.startswith("_"))]:
                doc = inspect.getdoc(obj) if inspect.ismodule(obj) or inspect.isclass(obj) or callable(obj) else None
                if doc and len(doc) > 200 and doc not in docs:
                    docs.append(doc)
    random.Random(0).shuffle(docs)
    with open(path, "w") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")
    return len(docs)


def train_tokenizer(corpus: Path, prefix: Path) -> Path:
    """A BPE SentencePiece model of VOCAB pieces trained on the corpus (in this process, no download)."""
    spm = require("sentencepiece", "pip install -e '.[stock]'")
    text = prefix.with_suffix(".txt")
    with open(corpus) as src, open(text, "w") as dst:
        for line in src:
            dst.write(json.loads(line)["text"] + "\n")
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(prefix), vocab_size=VOCAB, model_type="bpe",
                                   character_coverage=1.0, num_threads=1, minloglevel=2)
    return prefix.with_suffix(".model")


def _env(**extra: str) -> dict[str, str]:
    root = os.environ["MEGATRON_LM_ROOT"]
    return {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p), **extra}


def preprocess(corpus: Path, model: Path, prefix: Path, log: Path) -> Path:
    """The checkout's tools/preprocess_data.py (through `portspeed run`: it imports megatron.training)."""
    root = os.environ["MEGATRON_LM_ROOT"]
    res = run_python(["-m", "portspeed.cli", "run", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
                      "--master-port", str(free_port()), f"{root}/tools/preprocess_data.py", "--input", str(corpus),
                      "--output-prefix", str(prefix), "--tokenizer-type", "GPTSentencePieceTokenizer",
                      "--tokenizer-model", str(model), "--workers", "1", "--append-eod"],
                     timeout=TIMEOUT, env=_env())
    log.write_text(res.stdout + res.stderr)
    assert res.returncode == 0, f"preprocess_data.py failed (exit {res.returncode}); log {log}:\n{res.stderr[-3000:]}"
    data = Path(f"{prefix}_text_document")
    assert data.with_suffix(".bin").is_file() and data.with_suffix(".idx").is_file(), sorted(os.listdir(prefix.parent))
    return data


def train(work: Path, name: str, nproc: int, tp: int, data: Path, model: Path, iters: int, *extra: str) -> str:
    """examples/stock/pretrain_gpt_cpu.sh on the dataset (its flags, then the tokenizer's, then ``extra``)."""
    require_stock_packages()
    log = work / f"{name}.log"
    env = _env(NPROC=str(nproc), TP=str(tp), PP="1", ITERS=str(iters), DATA_PATH=str(data),
               PORTSPEED=f"{sys.executable} -m portspeed.cli",
               PET_MASTER_ADDR="127.0.0.1", PET_MASTER_PORT=str(free_port()))  # torchrun reads PET_* options
    with venv_python_first():
        # the example is a bash script: run it in its own session, killed whole on time-out
        full = os.environ | {"OMP_NUM_THREADS": "1"} | env
        res = run_command(["bash", str(EXAMPLE), *TOKENIZER, "--tokenizer-model", str(model), *extra], TIMEOUT,
                          full, cwd=work)
    out = res.stdout + res.stderr
    log.write_text(out)
    assert res.returncode == 0, f"{name} failed (exit {res.returncode}); log {log}:\n{out[-4000:]}"
    return out


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("stock_dataset")
    corpus = work / "corpus.jsonl"
    n_docs = write_corpus(corpus)
    model = train_tokenizer(corpus, work / "spm")
    data = preprocess(corpus, model, work / "corpus", work / "preprocess.log")
    ckpt = work / "ckpt"
    train(work, "init", 1, 1, data, model, 3, "--save", str(ckpt), "--save-interval", "3")
    finetune = ("--load", str(ckpt), "--finetune")
    tp1 = train(work, "tp1", 1, 1, data, model, ITERS, *finetune)
    return {"work": work, "docs": n_docs, "model": model, "data": data, "finetune": finetune, "tp1": tp1}


def test_the_dataset_is_tokenized_text(dataset: dict) -> None:
    """The indexed dataset holds the corpus's documents as SentencePiece ids below the vocabulary, each ending in </s>.
    """
    spm = require("sentencepiece", "pip install -e '.[stock]'")
    sp = spm.SentencePieceProcessor(model_file=str(dataset["model"]))
    assert sp.get_piece_size() == VOCAB
    idx = dataset["data"].with_suffix(".idx").read_bytes()
    # Megatron's .idx: magic, version, dtype code, then the sequence and document counts
    assert idx[:9] == b"MMIDIDX\x00\x00"
    n_seqs = struct.unpack("<Q", idx[18:26])[0]
    assert n_seqs == dataset["docs"], f"{n_seqs} sequences for {dataset['docs']} documents"
    log = dataset["tp1"]
    assert "GPTSentencePieceTokenizer" in log and "padded vocab (size: 500) with 12 dummy tokens" in log, (
        "the run did not use the trained tokenizer")
    first = json.loads(Path(dataset["work"] / "corpus.jsonl").read_text().splitlines()[0])["text"]
    assert sp.decode(sp.encode(first)) == " ".join(first.split()), "the tokenizer does not round-trip the corpus"


def test_tp2_matches_tp1_on_the_text_dataset(dataset: dict) -> None:
    ref = parse_megatron_log(dataset["tp1"], source="tp1")
    run = parse_megatron_log(train(dataset["work"], "tp2", 2, 2, dataset["data"], dataset["model"], ITERS,
                                   *dataset["finetune"]), source="tp2")
    assert len(ref.iterations) == len(run.iterations) == ITERS
    losses = [it.lm_loss for it in ref.iterations]
    assert losses[-1] < losses[0], f"TP1 did not learn on the text: {losses}"
    it, worst = max_diff(ref, run)
    print(f"text dataset tp2 vs tp1: max |lm loss diff| {worst:.3g} at iteration {it}; tp1 losses {losses}")
    assert worst <= TOLERANCE, f"iteration {it}: TP2 differs from TP1 by {worst:.3g}"
