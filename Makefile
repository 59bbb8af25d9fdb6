# Two entry points for a fresh machine: `make demo` and `make test`. Each builds .venv itself.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint reproduce rocm-plugin clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch from local disk first (CPU build), so that nothing pulls a multi-GB CUDA torch.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,inspect-cuda,inspect-rocm]'
	# Stand-in ROCm libraries (system cc), so that the MI300X deviceless tests run in `make test`.
	$(BIN)/python -m farskip_jax.inspect.rocm_standins build > /dev/null
	touch $(STAMP)

demo: $(STAMP)
	JAX_PLATFORMS=cpu $(BIN)/python train.py --config tiny_demo

# Two pytest workers (the CI machine's 2 cores; XLA compiles on one thread), each test file on one
# worker so that module fixtures are built once.
test: $(STAMP)
	JAX_PLATFORMS=cpu $(BIN)/python -m pytest -q -n 2 --dist loadfile

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
# manifest (libraries, exported functions) is printed.
rocm-plugin: $(STAMP)
	$(BIN)/pip install -q -e '.[inspect-rocm]'
	$(BIN)/python -m farskip_jax.inspect.rocm_standins build

clean:
	rm -rf $(VENV)
