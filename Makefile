# Two commands on a fresh machine:  `make demo`  and  `make test`.
#
# CI has two legs, and `make test` runs both (`.ci/run` calls it):
#   leg 1: $(PYTHON) (3.11 on CI), torch 2.13.0 CPU wheel, megatron-core 0.16.1   -> .venv,    constraints.txt
#   leg 2: Python 3.12, PyPI's torch 2.15.0 (a CUDA build; CI has no GPU),
#          megatron-core 0.19.2, DeepSpeed 0.19.8, Megatron-Bridge 0.6.2          -> .venv312, constraints-py312.txt
#          (torch 2.14.1 on the same stack by hand: `make test-leg2-torch2.14`)
# One leg alone: `make test-leg1` or `make test-leg2`. Every venv recipe is the same one,
# parameterised by PYTHON / VENV / CONSTRAINTS / TORCH_VERSION (a recursive make for leg 2).
PYTHON      ?= python3
VENV        ?= .venv
CONSTRAINTS ?= constraints.txt
# the torch each leg installs first: the `torch==` line of its constraints file (2.13.0 for leg 1,
# 2.15.0 for leg 2), so the pin and the constraints cannot disagree; a TORCH_VERSION=... that
# differs from that line fails the venv recipe
TORCH_VERSION ?= $(shell sed -n 's/^torch==\([^ ]*\).*/\1/p' "$(CONSTRAINTS)" 2>/dev/null)
PY          := $(VENV)/bin/python
# A machine's pip configuration may cap torch: the shared build machine's does (`torch<=2.14.1` in
# /etc/xdg/pip, the releases its disk holds), which makes leg 2's torch 2.15.0 unresolvable. Each leg's
# constraints file pins its own torch, so every pip command that installs into a leg's venv sets the
# machine's constraint aside (PIP_CONSTRAINT=/dev/null replaces it for that one command) and answer to
# the leg's file alone; nothing else is changed, and the machine's configuration is left as it is.
LEG_PIP     := PIP_CONSTRAINT=/dev/null
STAMP       := $(VENV)/.installed
# Python 3.12 for leg 2: PYTHON312=..., else pyenv's 3.12, else a python3.12 that runs
PYTHON312   ?= $(shell { p=$$(pyenv prefix 3.12 2>/dev/null) && echo $$p/bin/python3; } || \
                 { python3.12 -c 'import sys; print(sys.executable)' 2>/dev/null; })
#: leg 2 runs the parts a Python 3.12 / CUDA-build user meets first (adaptor, translation, router,
#: Megatron parity, DeepSpeed, versions and drift). Markers pick what belongs to one leg only:
#: `cuda_build` (PyPI's CUDA torch: leg 2), `cpu_wheel` (the CPU wheel: leg 1); `testdev` and
#: `stock` (needs MEGATRON_LM_ROOT) are leg 1's.
LEG2_TESTS  := tests/test_activation.py tests/test_megatron_adaptor.py tests/test_translation.py \
               tests/test_translation_views.py tests/test_router.py tests/test_router_rewrites.py \
               tests/test_collective_conformance.py tests/test_selection.py tests/test_megatron_core_parity.py \
               tests/test_deepspeed.py tests/test_deepspeed_adaptor.py tests/test_versions.py \
               tests/test_cuda_build.py tests/test_drift.py tests/test_megatron_moe.py tests/test_megatron_refusals.py \
               tests/test_view_classes.py tests/test_narrowing.py tests/test_te_kernels.py tests/test_te_attention.py \
               tests/test_te_ring.py tests/test_te_ring_megatron.py tests/test_rl_loop.py tests/test_hf_trainer.py \
               tests/test_rl_fsdp.py tests/test_megatron_bridge.py tests/test_exit.py tests/test_warm_python.py
LEG1_MARKS  := not cuda_build and not ds_more and not faults and not megatron_bridge
LEG2_MARKS  := not cpu_wheel and not testdev and not stock and not ds_more
#: ... and, on leg 2's torch 2.15, how portspeed's flight recorder and NaN check live with torch's own hooks
#: (Gloo's and testccl's recorders, NanCheckHook): the cases marked `torch_hooks`, the test device's included
LEG2_HOOK_TESTS := tests/test_trace.py tests/test_nan_check.py

.PHONY: test-perf-stock stress stress-exit venv venv312 testdev demo test test-leg1 test-leg2 setup-leg1 setup-leg2 leg2-deps \
        run-leg1 run-leg2 run-leg1-main run-leg1-wait run-leg2-main run-leg2-wait test-leg2-torch2.14 test-stock test-stock-matrix test-probe-stock test-stock-bare stock-tag-venvs stock-tests megatron-unit-tests bench clean \
        sysdeps ds-ops test-deepspeed-more

## Debian packages the tests need: Open MPI (mpirun, and the library mpi4py loads) for DeepSpeed's MPI
## discovery, libaio-dev for its async I/O op (ZeRO-Infinity), gdb for the native backtraces of a child
## that aborts (portspeed.testing.cores). Installed when missing
## (as root, with apt-get); anything else fails here naming the command to run.
SYSTEM_PACKAGES := openmpi-bin libopenmpi-dev libaio-dev gdb
sysdeps:
	@missing=$$(for p in $(SYSTEM_PACKAGES); do dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing Debian packages: $$missing"; \
	    apt-get install -y --no-install-recommends $$missing || { apt-get update && apt-get install -y --no-install-recommends $$missing; } || \
	      { echo "could not install $$missing with apt-get; install them (apt-get install -y $$missing) and re-run make"; exit 2; }; \
	  else echo "missing Debian packages: $$missing; install them as root: apt-get install -y $$missing"; exit 2; fi; fi

$(STAMP): pyproject.toml $(CONSTRAINTS) | sysdeps
	@grep -qx 'torch==$(TORCH_VERSION)' $(CONSTRAINTS) || { \
	  echo "TORCH_VERSION='$(TORCH_VERSION)' is not $(CONSTRAINTS)'s torch== line: pin torch there (or drop TORCH_VERSION=)"; exit 2; }
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: the rest must not pull another torch
	$(LEG_PIP) $(PY) -m pip install -q torch==$(TORCH_VERSION)
	# DS_BUILD_OPS=0: DeepSpeed installs without compiling any op (none is needed on CPU)
	DS_BUILD_OPS=0 $(LEG_PIP) $(PY) -m pip install -q -c $(CONSTRAINTS) -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

## DeepSpeed's host ops, JIT-built once into a cache inside the venv (torch's TORCH_EXTENSIONS_DIR,
## which the tests set for every run): CPU Adam (ZeRO-Offload), async I/O (ZeRO-Infinity; needs
## libaio-dev), pinned memory, and the shared-memory comm kernel stock DeepSpeed's CPU accelerator
## loads (the stock baseline). The venv installs DeepSpeed with DS_BUILD_OPS=0; a no-op once built.
## The tests (both legs) load CPU Adam and the shm kernel only; ZeRO-Infinity's async I/O (4-7 minutes of
## compiling on 2 cores, the longest step of CI's set-up) is loaded by the by-hand `make test-deepspeed-more`
## alone, which builds it (DS_OPS=all); CI checks that it can be built here (libaio present).
DS_OPS_DIR  = $(abspath $(VENV))/torch_extensions
CI_DS_OPS   := cpu_adam deepspeed_shm_comm
DS_OPS ?= $(CI_DS_OPS)
ds-ops: $(STAMP)
	TORCH_EXTENSIONS_DIR=$(DS_OPS_DIR) OMP_NUM_THREADS=1 $(PY) -m portspeed.integrations.ds_build \
	    $(filter-out all,$(DS_OPS))

## The test device (a C++ PrivateUse1 device, not hardware): compiled against the installed torch,
## cached in the venv; a no-op (about a second) when the sources did not change.
testdev: $(STAMP)
	$(PY) -m portspeed.testing.testdev build

## The main job: a Megatron-Core GPT trained on CPU/Gloo with TP, PP and DP through portspeed. Its set-up
## steps print one line each (apt-get's and pip's output goes to .setup-logs/, shown if a step fails).
demo:
	$(call step,Debian packages (apt-get when missing),sysdeps,sysdeps)
	$(call step,Python 3.11 venv (torch 2.13.0 CPU wheel + megatron-core 0.16.1) + the test device,demo,venv testdev)
	OMP_NUM_THREADS=1 $(PY) examples/demo.py

## The test suite (what CI runs): both legs. Both legs' set-ups run side by side first (leg 2's downloads
## beside leg 1's compiles; each step prints one line, its output kept in .setup-logs/), then each leg's
## tests, printing the 25 slowest. A failed test is never retried. On both cores with pytest-xdist
## (PYTEST_CI='-n 2 --dist loadfile --durations=25') a fresh clone measured leg 1 28 min 26 s and leg 2
## 12 min 21 s, against 25 min 7 s and 11 min 2 s on one worker: the multi-rank tests already use both
## cores, and two of them at once only share them (CONTRIBUTING.md, "How CI runs them").
PYTEST_CI   ?= --durations=25
## The tests that mostly wait: each plants a hang and sleeps out its 10-s hang timeout, so one run uses a
## fraction of a core. They run in a session of their own on three xdist workers (WAIT_XDIST), as the 750-run
## stress of their fault cases did (docs/reliability.md); `make test` runs both legs' such sessions side by side,
## last (their output printed as each ends). WAIT_XDIST= runs them on one worker.
WAIT_TESTS  := tests/test_trace.py tests/test_trace_unrecorded.py tests/test_trace_funcol.py tests/test_trace_megatron.py
WAIT_XDIST  ?= -n 3
test:
	$(call step,Debian packages (apt-get when missing),sysdeps,sysdeps)
	@$(MAKE) --no-print-directory -j2 --output-sync=line setup-leg1 setup-leg2
	@$(MAKE) --no-print-directory run-leg1-main
	@$(MAKE) --no-print-directory run-leg2-main
	@$(MAKE) --no-print-directory -j2 --output-sync=target run-leg1-wait run-leg2-wait

## One set-up step: one line on the terminal, its output in .setup-logs/NAME.log (shown when it fails).
SETUP_LOGS  := .setup-logs
define step
	@mkdir -p $(SETUP_LOGS); echo "set-up: $(1) (log: $(SETUP_LOGS)/$(2).log)"; \
	start=$$(date +%s); if $(MAKE) --no-print-directory $(3) > $(SETUP_LOGS)/$(2).log 2>&1; then \
	  echo "set-up: $(1): done in $$(( $$(date +%s) - start )) s"; \
	else echo "set-up: $(1) FAILED; the end of $(SETUP_LOGS)/$(2).log:"; tail -40 $(SETUP_LOGS)/$(2).log; exit 1; fi
endef

setup-leg1:
	$(call step,leg 1 (Python 3.11 / torch 2.13.0 CPU wheel): venv + test device + DeepSpeed ops,leg1,venv testdev ds-ops)
setup-leg2:
	$(call step,leg 2 (Python 3.12 / torch 2.15.0): venv + test device + DeepSpeed ops + Megatron-Bridge,leg2,leg2-deps)

## Leg 1: the whole suite on $(PYTHON) with the CPU torch wheel and megatron-core 0.16.1.
test-leg1: $(STAMP) testdev ds-ops
	@$(MAKE) --no-print-directory run-leg1
run-leg1: run-leg1-main run-leg1-wait
run-leg1-main:
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(PYTEST_CI) -m "$(LEG1_MARKS)" $(addprefix --ignore=,$(WAIT_TESTS))
run-leg1-wait:
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(PYTEST_CI) $(WAIT_XDIST) -m "$(LEG1_MARKS)" $(WAIT_TESTS)

## Megatron-Bridge (leg 2 only: it needs Python >= 3.12). --no-deps: its declared requirements do not install
## without CUDA (fast-hadamard-transform is an sdist that builds a CUDA extension; megatron-core[dev] pins an
## nvidia-resiliency-ext the index lacks) and the HF round trip imports none of them; omegaconf is the one it needs.
BRIDGE_STAMP := .venv312/.bridge-installed
$(BRIDGE_STAMP): constraints-py312.txt .venv312/.installed
	$(LEG_PIP) .venv312/bin/python -m pip install -q --no-deps -c constraints-py312.txt megatron-bridge omegaconf
	touch $@

## Leg 2: Python 3.12, PyPI torch (CUDA build, no GPU), megatron-core 0.19.2, DeepSpeed 0.19.8, Megatron-Bridge.
leg2-deps: venv312
	$(MAKE) --no-print-directory PYTHON="$(PYTHON312)" VENV=.venv312 CONSTRAINTS=constraints-py312.txt ds-ops testdev
	$(MAKE) --no-print-directory $(BRIDGE_STAMP)
test-leg2: leg2-deps
	@$(MAKE) --no-print-directory run-leg2
run-leg2: run-leg2-main run-leg2-wait
run-leg2-main:
	OMP_NUM_THREADS=1 .venv312/bin/python -m pytest -q $(PYTEST_CI) -m "$(LEG2_MARKS)" $(LEG2_TESTS)
run-leg2-wait:
	OMP_NUM_THREADS=1 .venv312/bin/python -m pytest -q $(PYTEST_CI) $(WAIT_XDIST) -m torch_hooks $(LEG2_HOOK_TESTS)

## torch 2.14.1 on leg 2's stack (Python 3.12, megatron-core 0.19.2, DeepSpeed 0.19.8, the Bridge), by hand since
## CI's leg 2 moved to torch 2.15.0: its own venv, leg 2's constraints with only the torch pin moved, leg 2's tests.
T214 := .venv312-torch2.14
$(T214).constraints.txt: constraints-py312.txt
	sed 's/^torch==.*/torch==2.14.1/' constraints-py312.txt > $@
test-leg2-torch2.14: $(T214).constraints.txt
	@test -n "$(PYTHON312)" || { echo "needs Python 3.12: set PYTHON312=/path/to/python3.12"; exit 2; }
	$(MAKE) --no-print-directory PYTHON="$(PYTHON312)" VENV=$(T214) CONSTRAINTS=$(T214).constraints.txt venv ds-ops
	$(LEG_PIP) $(T214)/bin/python -m pip install -q --no-deps -c $(T214).constraints.txt megatron-bridge omegaconf
	OMP_NUM_THREADS=1 $(T214)/bin/python -m pytest -q -m "$(LEG2_MARKS)" $(LEG2_TESTS)

venv312:
	@test -n "$(PYTHON312)" && "$(PYTHON312)" -c 'import sys; assert sys.version_info[:2] == (3, 12)' || { \
	  echo "leg 2 needs Python 3.12: set PYTHON312=/path/to/python3.12 (pyenv install 3.12 provides one)"; exit 2; }
	$(MAKE) --no-print-directory PYTHON="$(PYTHON312)" VENV=.venv312 CONSTRAINTS=constraints-py312.txt venv

## Tests against stock Megatron-LM (MEGATRON_LM_ROOT: a checkout at core_v0.16.1 ... core_v0.19.0).
## core_v0.16.x runs in leg 1's venv; core_v0.17 and later need Python 3.12, so they run in leg 2's.
STOCK_MINOR = $(shell sed -n 's/^MINOR = //p' "$(MEGATRON_LM_ROOT)/megatron/core/package_info.py" 2>/dev/null)
test-stock:
	@test -n "$(MEGATRON_LM_ROOT)" || { echo "set MEGATRON_LM_ROOT to a Megatron-LM checkout (tag core_v0.16.1 to core_v0.19.0)"; exit 2; }
	@test -n "$(STOCK_MINOR)" || { echo "MEGATRON_LM_ROOT=$(MEGATRON_LM_ROOT) has no megatron/core/package_info.py: not a Megatron-LM checkout"; exit 2; }
	@if [ "$(STOCK_MINOR)" -ge 17 ]; then \
	  $(MAKE) --no-print-directory venv312 && \
	  $(MAKE) --no-print-directory VENV=.venv312 CONSTRAINTS=constraints-py312.txt stock-tests; \
	else $(MAKE) --no-print-directory stock-tests; fi

stock-tests: $(STAMP)
	$(LEG_PIP) $(PY) -m pip install -q -c $(CONSTRAINTS) -e ".[stock]"
	$(PY) -m portspeed.testing.testdev build
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m stock tests/test_stock_megatron.py tests/test_stock_standin.py tests/test_megatron_unit_runner.py \
	    tests/test_stock_testdev.py tests/test_stock_llama.py tests/test_megatron_refusals.py tests/test_stock_moe.py \
	    tests/test_stock_fp16.py tests/test_stock_dataset.py tests/test_stock_te.py tests/test_stock_resume_layouts.py

## The stock matrix (by hand, about an hour on 2 cores): stock pretrain_gpt.py at core_v0.15.3 ... core_v0.19.0
## and main, each exported from MEGATRON_LM_GIT (a Megatron-LM git directory) with git archive, in TP2, PP2,
## DP2, TP2xPP2 and TP2 on the TE path launched from the checkout's root, TP2 also through `portspeed run`
## and a torchrun wrapper; each against TP1; the table goes into docs/megatron.md (benchmarks/stock_matrix.py).
test-stock-matrix:
	@test -n "$(MEGATRON_LM_GIT)" || { echo "set MEGATRON_LM_GIT to a Megatron-LM git directory (e.g. /work/.mirror/NVIDIA+Megatron-LM/repo)"; exit 2; }
	$(MAKE) --no-print-directory venv
	$(MAKE) --no-print-directory venv312
	$(LEG_PIP) .venv/bin/python -m pip install -q -c constraints.txt -e ".[stock]"
	$(LEG_PIP) .venv312/bin/python -m pip install -q -c constraints-py312.txt -e ".[stock]"
	OMP_NUM_THREADS=1 .venv/bin/python benchmarks/stock_matrix.py --git "$(MEGATRON_LM_GIT)"

## Both venvs with the test device and the stock script's extras, for the by-hand runs at every tag below.
stock-tag-venvs:
	@test -n "$(MEGATRON_LM_GIT)" || { echo "set MEGATRON_LM_GIT to a Megatron-LM git directory (e.g. /work/.mirror/NVIDIA+Megatron-LM/repo)"; exit 2; }
	$(MAKE) --no-print-directory venv testdev
	$(MAKE) --no-print-directory venv312
	$(MAKE) --no-print-directory PYTHON="$(PYTHON312)" VENV=.venv312 CONSTRAINTS=constraints-py312.txt testdev
	$(LEG_PIP) .venv/bin/python -m pip install -q -c constraints.txt -e ".[stock]"
	$(LEG_PIP) .venv312/bin/python -m pip install -q -c constraints-py312.txt -e ".[stock]"

## The probe on stock pretrain_gpt.py at every supported tag (by hand, about 15 minutes on 2 cores): probed and
## unprobed TP1 print the same losses, clean TP2 agrees with TP1, and the three planted faults (an all_reduce
## averaged, a NaN, the test device's rms_norm off by 1e-3) are named in the first line (benchmarks/probe_stock_tags.py).
test-probe-stock: stock-tag-venvs
	OMP_NUM_THREADS=1 .venv/bin/python benchmarks/probe_stock_tags.py --git "$(MEGATRON_LM_GIT)"

## --perf on stock pretrain_gpt.py at every supported tag (by hand, a few minutes a tag on 2 cores): two clean TP1
## runs name no part, and the three planted slownesses (a module slowed on the test device, .item() round trips,
## a slow TP2 rank) are named in compare --perf's first line (benchmarks/perf_stock_tags.py).
test-perf-stock: stock-tag-venvs
	OMP_NUM_THREADS=1 .venv/bin/python benchmarks/perf_stock_tags.py --git "$(MEGATRON_LM_GIT)"

## Stock pretrain_gpt.py (core_v0.16.1, leg 1) on the bare test device in TP2, from examples/day_one_adapter.py with
## the lines conformance printed pasted, against CPU TP1 from the same checkpoint, on the local and the TE path (by
## hand, about 10 minutes on 2 cores: benchmarks/stock_bare_device.py; docs/writing-an-adapter.md).
test-stock-bare:
	@test -n "$(MEGATRON_LM_GIT)" || { echo "set MEGATRON_LM_GIT to a Megatron-LM git directory (e.g. /work/.mirror/NVIDIA+Megatron-LM/repo)"; exit 2; }
	$(MAKE) --no-print-directory venv testdev
	$(LEG_PIP) .venv/bin/python -m pip install -q -c constraints.txt -e ".[stock]"
	OMP_NUM_THREADS=1 .venv/bin/python benchmarks/stock_bare_device.py --git "$(MEGATRON_LM_GIT)"

## Megatron-LM's own unit tests (tests/unit_tests of MEGATRON_LM_ROOT, core_v0.16.x with this venv) under
## portspeed on the active adapter, launched as Megatron's CI launches them: one torchrun per target.
## FILES: targets under tests/unit_tests (default: the set in docs/megatron-unit-tests.md); NPROC ranks (8).
MEGATRON_UNIT_FILES ?= test_parallel_state.py tensor_parallel/ pipeline_parallel/test_schedules.py distributed/ \
    transformer/test_transformer_block.py dist_checkpointing/test_serialization.py \
    dist_checkpointing/test_torch_dist.py dist_checkpointing/models/test_gpt_model.py
FILES ?= $(MEGATRON_UNIT_FILES)
NPROC ?= 8
megatron-unit-tests: $(STAMP)
	@test -n "$(MEGATRON_LM_ROOT)" || { echo "set MEGATRON_LM_ROOT to a Megatron-LM checkout (core_v0.16.x for this venv)"; exit 2; }
	$(LEG_PIP) $(PY) -m pip install -q -c $(CONSTRAINTS) -e ".[megatron-tests]"
	OMP_NUM_THREADS=1 $(PY) -m portspeed.cli megatron-tests --root "$(MEGATRON_LM_ROOT)" --nproc-per-node $(NPROC) \
	    --timeout 1800 $(FILES)

## The longer DeepSpeed checks (not in CI): ZeRO-3 on 4 ranks, the pipeline engine (2 stages, 2x2 on
## 4 ranks, resume, activation checkpointing), ZeRO-Infinity (nvme), the `deepspeed` launcher,
## stock DeepSpeed's own failures on CPU; the 2026 features against stock DeepSpeed, qgZ on one node
## and on 2 nodes x 2 ranks, DeepSpeed's generated zero_to_fp32.py.
test-deepspeed-more: $(STAMP) testdev
	$(MAKE) --no-print-directory DS_OPS=all ds-ops
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m ds_more tests/test_deepspeed_more.py tests/test_deepspeed_features.py

## Checkpoints and faults of the example trainer (cross-layout resume, crash during save, restart after a
## dead rank, two nodes on one machine): ~6 minutes on 2 cores, so by hand, not CI (docs/reliability.md).
test-faults: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -s -m faults tests/test_faults.py

## A flake is a bug (docs/reliability.md): rerun one test N times in leg 1's venv (pytest-repeat), never retried in CI.
##   make stress T=tests/test_trace.py::test_planted_fault_is_named_in_the_closing_lines[standin-op] N=50
N ?= 20
stress: $(STAMP) testdev
	@test -n "$(T)" || { echo "name the test: make stress T='tests/test_x.py::test_y[case]' N=50"; exit 2; }
	@# pytest-repeat renames test[case] to test[case-1-N]: a parametrized id is selected as the function plus -k case
	@t='$(T)'; case "$$t" in *'['*) k="$${t#*[}"; k="$${k%]}"; t="$${t%%[*}";; *) k="";; esac; \
	set -x; OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:randomly --count $(N) -m "" "$$t" $${k:+-k "$$k"}

## The exit-time abort (docs/reliability.md, "The abort at exit"), by hand: RUNS short jobs (one process, and two
## ranks) that leave without destroy_process_group, counting aborts; CONTROL=1 runs them without portspeed's
## exit teardown (torch alone). VENV=.venv312 for leg 2's torch.
RUNS ?= 1000
stress-exit: $(STAMP) testdev
	OMP_NUM_THREADS=1 $(PY) tests/helpers/exit_stress.py --runs $(RUNS) $(if $(CONTROL),--no-portspeed)

bench: $(STAMP)
	for b in benchmarks/bench_*.py; do OMP_NUM_THREADS=1 $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) .venv312 $(T214) $(T214).constraints.txt build *.egg-info
