# Two entry points for a fresh machine: `make demo` and `make test`. Each builds .venv itself.
#
# Python >= 3.12 (jax 0.12 and tokamax publish wheels for 3.12 and later only): PY=... if given,
# else the first of python3.12, python3.13, python3 on PATH that runs and is new enough (a pyenv
# shim for a version pyenv is not set to does not run), else an installed pyenv 3.12 or 3.13.
FIND_PY := for p in python3.12 python3.13 python3 $$(pyenv root 2>/dev/null)/versions/3.1[23]*/bin/python; do \
	"$$p" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1 && { echo "$$p"; break; }; done
PY ?= $(shell $(FIND_PY))
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint reproduce rocm-plugin clean

$(STAMP): pyproject.toml
	@test -n "$(PY)" || { echo "error: farskip-jax needs Python >= 3.12 (jax 0.12, tokamax): none found as python3.12, python3.13, python3 or under pyenv; install one, or pass PY=/path/to/python3.12" >&2; exit 1; }
	# --clear: a venv of another Python (an older checkout's 3.11) is rebuilt, not mixed.
	$(PY) -m venv --clear $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,inspect-cuda,inspect-rocm]'
	# Stand-in ROCm libraries (system cc), so that the MI300X deviceless tests run in `make test`.
	$(BIN)/python -m farskip_jax.xla.rocm_standins build > /dev/null
	touch $(STAMP)

demo: $(STAMP)
	JAX_PLATFORMS=cpu $(BIN)/python train.py --config tiny_demo

# Two pytest workers (the CI machine's 2 cores; XLA compiles on one thread), each test file on one
# worker so that module fixtures are built once; --durations: the CI log shows where the time goes.
test: $(STAMP)
	JAX_PLATFORMS=cpu $(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=25

lint: $(STAMP)
	$(BIN)/ruff check .

# REPRODUCE_FLAGS=--ablations adds section (f)'s FCSD ablation runs (~45 min on 2 cores, resumable);
# REPRODUCE_FLAGS=--sparsity-sweep adds section (e)'s deviceless compiles (bench/sparsity_sweep.py,
# ~30 min on 2 cores, resumable); without it (e) is rewritten from results/sparsity_sweep.json.
REPRODUCE_FLAGS ?=
reproduce: $(STAMP)
	JAX_PLATFORMS=cpu $(BIN)/python -m farskip_jax.reproduce --out results $(REPRODUCE_FLAGS)

# The ROCm deviceless compile path (MI300X target) is part of the venv above; this target re-checks
# it by hand: stand-ins are rebuilt when the plugin changed (keyed by its size and mtime), and the
# manifest (libraries, version nodes, functions) is printed.
rocm-plugin: $(STAMP)
	$(BIN)/python -m farskip_jax.xla.rocm_standins build

clean:
	rm -rf $(VENV)
