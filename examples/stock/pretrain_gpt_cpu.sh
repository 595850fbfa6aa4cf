#!/usr/bin/env bash
# Stock Megatron-LM pretrain_gpt.py (unedited) on CPU/Gloo through `portspeed run`.
# The command line is a GPU user's, minus Transformer Engine and apex (--transformer-impl local);
# Megatron's default --distributed-backend nccl is left as it is: portspeed routes it.
#
#   MEGATRON_LM_ROOT=/path/to/Megatron-LM  NPROC=2 TP=2 PP=1  examples/stock/pretrain_gpt_cpu.sh [extra args]
#
# NPROC must be a multiple of TP*PP (the rest is data parallelism). DATA_PATH=<prefix> trains on
# an indexed dataset (made with the checkout's tools/preprocess_data.py, see README in this
# folder) instead of Megatron's mock data. Extra arguments are passed to pretrain_gpt.py last
# (e.g. --save/--load/--finetune).
set -euo pipefail
: "${MEGATRON_LM_ROOT:?set MEGATRON_LM_ROOT to a Megatron-LM checkout (tag core_v0.16.1)}"
NPROC=${NPROC:-2}
TP=${TP:-1}
PP=${PP:-1}
ITERS=${ITERS:-10}
PORTSPEED=${PORTSPEED:-portspeed}
if [[ -n "${DATA_PATH:-}" ]]; then
    DATA=(--data-path "$DATA_PATH" --split 100,0,0)
else
    DATA=(--mock-data)
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export PYTHONPATH="$MEGATRON_LM_ROOT${PYTHONPATH:+:$PYTHONPATH}"

# vocab 1000 pads to 1024 for TP 1, 2 and 4 alike (the padded size depends on TP),
# so every layout trains the same model.
exec $PORTSPEED run --nproc-per-node "$NPROC" "$MEGATRON_LM_ROOT/pretrain_gpt.py" \
    --transformer-impl local \
    "${DATA[@]}" --tokenizer-type NullTokenizer --vocab-size 1000 \
    --num-layers 2 --hidden-size 64 --num-attention-heads 4 \
    --seq-length 32 --max-position-embeddings 32 \
    --micro-batch-size 2 --global-batch-size 8 \
    --train-iters "$ITERS" --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 2 --lr-decay-iters 10 \
    --weight-decay 0.01 --clip-grad 1.0 --seed 1234 \
    --attention-dropout 0.0 --hidden-dropout 0.0 \
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" \
    --log-interval 1 --eval-iters 0 --eval-interval "$ITERS" \
    --num-workers 0 \
    "$@"
