#!/usr/bin/env bash
# Download, HERE (a machine with PyPI), the wheels benchmarks/gpu_check.sh installs on a GPU machine that
# cannot download anything: into .whl/ at the repository root (git-ignored; name it in the device call's carry).
#
# Why these: the GPU image has torch 2.11 (CUDA 13), numpy, packaging, psutil, wrapt and zipp, but no
# megatron-core. megatron-core 0.19.2 (cp312, manylinux_2_24/2_28 x86_64) asks for torch>=2.6, numpy,
# packaging>=24.2: torch 2.11 meets them, and it is leg 2's release (constraints-py312.txt).
# importlib_metadata: a declared dependency of portspeed (pyproject.toml), absent from the image's list.
#
#   bash benchmarks/gpu_wheels.sh            # then: ls .whl  (total must stay under 40 MiB)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WANT=("megatron-core==0.19.2" "importlib-metadata==8.7.0")
mkdir -p .whl
for spec in "${WANT[@]}"; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    --platform any -d .whl "$spec"
done
# one version of each package: two stop the whole install on the GPU machine
dups=$(ls .whl/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z-' 'a-z_' | sort | uniq -d)
if [ -n "$dups" ]; then echo "gpu_wheels: more than one wheel of: $dups; delete the old ones in .whl/" >&2; exit 1; fi
kib=$(du -sk .whl | cut -f1)
ls -l .whl
echo "gpu_wheels: .whl/ holds $((kib / 1024)) MiB"
if [ "$kib" -gt $((40 * 1024)) ]; then echo "gpu_wheels: over 40 MiB; the device call carries at most 64 MiB" >&2; exit 1; fi
