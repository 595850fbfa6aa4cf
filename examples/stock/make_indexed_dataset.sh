#!/usr/bin/env bash
# Make a small Megatron indexed dataset (.bin/.idx) with the checkout's own tools/preprocess_data.py,
# tokenized by NullTokenizer (token ids written as numbers: nothing to download).
#
#   MEGATRON_LM_ROOT=/path/to/Megatron-LM  examples/stock/make_indexed_dataset.sh OUT_DIR
#
# Then train on it:  DATA_PATH=OUT_DIR/docs_text_document examples/stock/pretrain_gpt_cpu.sh
# preprocess_data.py imports megatron.training, so it runs through `portspeed run` too.
set -euo pipefail
: "${MEGATRON_LM_ROOT:?set MEGATRON_LM_ROOT to a Megatron-LM checkout (tag core_v0.16.1)}"
OUT=${1:?usage: make_indexed_dataset.sh OUT_DIR}
PYTHON=${PYTHON:-python}
PORTSPEED=${PORTSPEED:-portspeed}
mkdir -p "$OUT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export PYTHONPATH="$MEGATRON_LM_ROOT${PYTHONPATH:+:$PYTHONPATH}"

# 200 documents of counting runs over token ids 0..99 (learnable, so a few steps lower the loss)
"$PYTHON" - "$OUT/docs.jsonl" <<'PY'
import json, random, sys
rng = random.Random(0)
with open(sys.argv[1], "w") as f:
    for _ in range(200):
        start, step, n = rng.randrange(100), rng.choice((1, 2, 3)), rng.randint(20, 120)
        f.write(json.dumps({"text": " ".join(str((start + i * step) % 100) for i in range(n))}) + "\n")
PY

$PORTSPEED run --nproc-per-node 1 "$MEGATRON_LM_ROOT/tools/preprocess_data.py" \
    --input "$OUT/docs.jsonl" --output-prefix "$OUT/docs" \
    --tokenizer-type NullTokenizer --vocab-size 1000 --workers 1 --append-eod
echo "dataset: $OUT/docs_text_document.{bin,idx}"
