#!/usr/bin/env bash
# One command for a lent GPU (one H100/H200, torch 2.11 with CUDA 13 preinstalled, nothing downloadable):
#
#   bash benchmarks/gpu_check.sh             # on the GPU machine, from the repository root; 4-7 minutes
#   bash benchmarks/gpu_check.sh --dry-run   # the same steps, tiny, on the host's CPU (also GPU_CHECK_DRY_RUN=1)
#
# What it needs there: this source tree (portspeed runs from it: PYTHONPATH, no pip install, no entry
# points; benchmarks/gpu_site/sitecustomize.py maps portspeed.adapters / portspeed.patches onto adapters/
# and patches/) and, unless megatron-core already imports, the wheels in .whl/ at the repository root:
#   megatron_core-0.19.2-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl  (requires torch>=2.6)
#   importlib_metadata-8.7.0-py3-none-any.whl                                            (portspeed's declared dep)
# `bash benchmarks/gpu_wheels.sh` downloads them here (about 2.4 MB); the device call names .whl in carry.
#
# Parts, each bounded by `timeout`; a failure is a row of the table, never the end of the run:
#   preflight    torch, the GPU, megatron-core, where portspeed imports from
#   conformance  the cuda adapter's conformance kit on one rank: the device and kernels suites (the collective
#                and training suites need 2 ranks, which NCCL refuses on one GPU); NCCL on one rank runs in 'example'
#   example      examples/pretrain_gpt.py, 1 GPU, with portspeed vs every patch blocked: step-time ratio (goal <= 1.005)
#   te           the example GPT on Megatron's TE spec over the portable TE (torch kernels), the same with
#                PORTSPEED_TE_KERNELS=reference, and Megatron's local spec: step time, peak memory, SDPA ops
#   attention    benchmarks/bench_te_kernels.py's attention table on the GPU (fp32, bf16; MHA, GQA; 1k-16k)
#   extra_*      (GPU only, if present, in the time left) benchmarks/check_sdpa_cuda.py, check_te_kernels_cuda.py,
#                bench_grouped_stack.py --device cuda, check_trace_nccl.py (torch's NCCL flight recorder dumped
#                by portspeed's hang watchdog and at exit, read by why-hung): their own output is in their logs
# Prints one table at the end; logs and JSON in $GPU_CHECK_LOGS (default /tmp/gpu_check), packed into
# $OUT/gpu_check_logs.tgz (with $OUT/gpu_check_table.txt) when OUT is set.
set -u
cd "$(dirname "$0")/.."
REPO=$PWD
DRY=${GPU_CHECK_DRY_RUN:-0}
[ "${1:-}" = "--dry-run" ] && DRY=1
PY=${PYTHON:-python3}
LOGS=${GPU_CHECK_LOGS:-/tmp/gpu_check}  # every log and JSON; packed into $OUT at the end (the device tool
mkdir -p "$LOGS"                         # brings back at most 8 files from $OUT)
rm -f "$LOGS"/*.json "$LOGS"/*.status "$LOGS"/*.log
# seconds per part (and per process inside it), and for the whole run: every part is cut to what is left
# of DEADLINE, so the GPU run ends inside 8 minutes (typically about 4) whatever hangs
if [ "$DRY" = 1 ]; then
  DEVICE=cpu; ADAPTER=cpu; SEQS=128; DTYPES=fp32
  # generous: a shared CI machine can be slow; these bounds catch hangs, they time nothing
  T_PRE=600; T_CONF=600; T_EX=1200; T_EX1=580; T_TE=1500; T_TE1=480; T_ATT=900; T_ALL=4000
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
else
  DEVICE=cuda; ADAPTER=cuda; SEQS=1024,2048,4096,8192,16384; DTYPES=fp32,bf16
  T_PRE=60; T_CONF=45; T_EX=130; T_EX1=55; T_TE=120; T_TE1=55; T_ATT=100; T_ALL=440
fi
DEADLINE=$(( $(date +%s) + T_ALL ))

# megatron-core from .whl/ when it does not import already (the GPU image has none)
if ! timeout 30 "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('megatron.core') is None)" 2>/dev/null; then
  if ls .whl/megatron_core-*.whl >/dev/null 2>&1; then
    SITE=/tmp/gpu_check_site
    timeout 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
      >"$LOGS/wheels.log" 2>&1 || echo "gpu_check: installing .whl/*.whl failed; see $LOGS/wheels.log" >&2
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "gpu_check: megatron-core does not import and .whl/ has no megatron_core wheel;" \
         "run 'bash benchmarks/gpu_wheels.sh' where PyPI is reachable and carry .whl" >&2
  fi
fi
export PYTHONPATH="$REPO/benchmarks/gpu_site:$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore GPU_CHECK_OUT="$LOGS"

# part NAME SECONDS CMD...: run CMD under timeout, log to $LOGS/NAME.log, record how it ended in NAME.status
part() {
  local name=$1 secs=$2 rc start
  shift 2
  start=$(date +%s)
  [ $((DEADLINE - start)) -lt "$secs" ] && secs=$((DEADLINE - start))
  if [ "$secs" -lt 5 ]; then
    echo "not run: the run's ${T_ALL} s were spent" >"$LOGS/$name.status"
    echo "== $name: $(cat "$LOGS/$name.status")"
    return
  fi
  echo "== $name (at most ${secs} s): $*"
  timeout --kill-after=5 "$secs" "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    echo "timed out after $secs s" >"$LOGS/$name.status"
  else
    echo "exit $rc" >"$LOGS/$name.status"
  fi
  echo "   $(cat "$LOGS/$name.status") in $(( $(date +%s) - start )) s; log $LOGS/$name.log"
  tail -n 3 "$LOGS/$name.log" | cut -c1-300 | sed 's/^/   | /'
}

part preflight $T_PRE "$PY" benchmarks/gpu_check.py preflight --device $DEVICE --out "$LOGS"
SUITES=device
# a kernel suite, when the conformance kit has one (issue 23's vendor-slot checks), fits one GPU too
if timeout 30 "$PY" -c "import sys; from portspeed.conformance.__main__ import SUITES; sys.exit('kernels' not in SUITES)" 2>/dev/null; then
  SUITES=device,kernels
fi
part conformance $T_CONF "$PY" -m portspeed.conformance --adapter $ADAPTER --suites $SUITES --json "$LOGS/conformance.json"
part example $T_EX "$PY" benchmarks/gpu_check.py example --device $DEVICE --out "$LOGS" --timeout $T_EX1
part te $T_TE "$PY" benchmarks/gpu_check.py te --device $DEVICE --out "$LOGS" --timeout $T_TE1
part attention $T_ATT "$PY" benchmarks/bench_te_kernels.py --parts attention --device $DEVICE --seqs $SEQS \
  --dtypes $DTYPES --json "$LOGS/attention.json" --case-timeout $T_EX1
# the GPU-only checks (the probe's cost, SDPA, kernels, grouped GEMM, torch's NCCL recorder), when present, in what time is left (their output: the logs)
if [ "$DRY" != 1 ]; then
  [ -f benchmarks/check_probe_cuda.py ] && part extra_check_probe_cuda 150 "$PY" benchmarks/check_probe_cuda.py \
    --device cuda --out "$LOGS" --timeout 70
  [ -f benchmarks/check_sdpa_cuda.py ] && part extra_check_sdpa_cuda 90 "$PY" benchmarks/check_sdpa_cuda.py
  [ -f benchmarks/check_te_kernels_cuda.py ] && part extra_check_te_kernels_cuda 60 "$PY" benchmarks/check_te_kernels_cuda.py
  [ -f benchmarks/bench_grouped_stack.py ] && part extra_bench_grouped_stack 60 "$PY" benchmarks/bench_grouped_stack.py \
    --device cuda
  [ -f benchmarks/check_trace_nccl.py ] && part extra_check_trace_nccl 150 "$PY" benchmarks/check_trace_nccl.py \
    --out "$LOGS"
fi

echo
echo "gpu_check ($([ "$DRY" = 1 ] && echo 'dry run on the CPU' || echo GPU)), $(date -u +%Y-%m-%dT%H:%MZ):"
"$PY" benchmarks/gpu_check.py table --out "$LOGS" >"$LOGS/table.txt" 2>&1
RC=$?  # 0: every part ran and passed; 1: the table names the parts that did not
cat "$LOGS/table.txt"
if [ -n "${OUT:-}" ] && [ "$OUT" != "$LOGS" ]; then
  mkdir -p "$OUT" && cp "$LOGS/table.txt" "$OUT/gpu_check_table.txt" &&
    tar -czf "$OUT/gpu_check_logs.tgz" -C "$LOGS" . && echo "logs: $OUT/gpu_check_logs.tgz, table: $OUT/gpu_check_table.txt"
fi
exit $RC
