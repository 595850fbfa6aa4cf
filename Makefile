# Two commands on a fresh machine:  `make demo`  and  `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: venv testdev demo test test-stock bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	# the pinned CPU torch first: an unpinned torch pulls several GB of CUDA wheels
	$(PY) -m pip install -q torch==2.13.0
	# DS_BUILD_OPS=0: DeepSpeed installs without compiling any op (none is needed on CPU)
	DS_BUILD_OPS=0 $(PY) -m pip install -q -c constraints.txt -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

## The test device (a C++ PrivateUse1 device, not hardware): compiled against the installed torch,
## cached in the venv; a no-op (about a second) when the sources did not change.
testdev: $(STAMP)
	$(PY) -m portspeed.testing.testdev build

## The main job: a Megatron-Core GPT trained on CPU/Gloo with TP, PP and DP through portspeed.
demo: $(STAMP) testdev
	OMP_NUM_THREADS=1 $(PY) examples/demo.py

## The test suite (what CI runs).
test: $(STAMP) testdev
	OMP_NUM_THREADS=1 $(PY) -m pytest -q

## Tests against stock Megatron-LM; needs MEGATRON_LM_ROOT pointing at a core_v0.16.1 checkout.
test-stock: $(STAMP)
	@test -n "$(MEGATRON_LM_ROOT)" || { echo "set MEGATRON_LM_ROOT to a Megatron-LM checkout at tag core_v0.16.1"; exit 2; }
	$(PY) -m pip install -q -c constraints.txt -e ".[stock]"
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m stock tests/test_stock_megatron.py tests/test_stock_standin.py

bench: $(STAMP)
	for b in benchmarks/bench_*.py; do OMP_NUM_THREADS=1 $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info
