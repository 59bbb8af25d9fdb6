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
	$(BIN)/pip install -q -e '.[test,inspect-cuda]'
	touch $(STAMP)

demo: $(STAMP)
	JAX_PLATFORMS=cpu $(BIN)/python train.py --config tiny_demo

test: $(STAMP)
	JAX_PLATFORMS=cpu $(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .

reproduce: $(STAMP)
	JAX_PLATFORMS=cpu $(BIN)/python -m farskip_jax.reproduce --out results

# Optional: the ROCm deviceless compile path (MI300X target) for the inspector.
rocm-plugin: $(STAMP)
	$(BIN)/pip install -q -e '.[inspect-rocm]'
	$(BIN)/python -m farskip_jax.inspect.rocm_standins build

clean:
	rm -rf $(VENV)
