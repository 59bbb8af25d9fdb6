# Two entry points for a fresh machine: `make demo` and `make test`. Each builds .venv itself.
#
# Python >= 3.12 (jax 0.12 and tokamax publish wheels for 3.12 and later only): PY=... if given,
# else the first of python3.12, python3.13, python3 on PATH that runs and is new enough (a pyenv
# shim for a version pyenv is not set to does not run), else an installed pyenv 3.12 or 3.13 (found
# by `pyenv root`, or in $PYENV_ROOT / ~/.pyenv when pyenv is not on PATH, as in a bare shell).
FIND_PY := for p in python3.12 python3.13 python3 $$(pyenv root 2>/dev/null)/versions/3.1[23]*/bin/python \
	$${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.1[23]*/bin/python; do \
	"$$p" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1 && { echo "$$p"; break; }; done
PY ?= $(shell $(FIND_PY))
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint reproduce rocm-plugin maxtext-peer clean

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

# A peer in the same run (bench/maxtext_peer.py): MaxText's train step for its deepseek2-16b config,
# compiled deviceless for 8 x H200 and 8 x MI300X and read by our inspector, in three variants
# (MaxText's defaults; attention=dot_product; and + ragged_buffer_factor=2.0), ~1-3 min each on
# 2 cores. MaxText is an optional extra, kept out of .venv: it goes into $(MAXTEXT_SITE) with
# --no-deps, with only the modules its train step imports that .venv lacks (pinned here).
# MAXTEXT_PEER_OURS=1 also compiles our side of the table, `inspect --mode train --compare-regular`
# on the same mesh and tokens (~15 min on H200, longer on MI300X: PGLE compiles twice), unless its
# compare.json is there. MAXTEXT_PEER_TARGETS=h200 for one target; MAXTEXT_PEER_FLAGS="--layers 3
# --seq-len 1024 --seqs-per-device 1" for a reduced run.
MAXTEXT_SITE := .maxtext-site
MAXTEXT_PINS := maxtext==0.2.5 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 aqtp==0.9.0 drjax==0.2.1 \
	pathwaysutils==0.1.11 fastapi==0.141.1 starlette==1.6.0 uvicorn==0.53.0 tiktoken==0.14.0 \
	sentencepiece==0.2.2
MAXTEXT_PEER_TARGETS ?= h200 mi300x
MAXTEXT_PEER_OUT ?= bench/results/maxtext_peer
MAXTEXT_PEER_FLAGS ?=
MAXTEXT_PEER_OURS ?=

$(MAXTEXT_SITE)/.installed: Makefile $(STAMP)
	$(BIN)/python -m pip install -q --no-deps --prefer-binary --upgrade --target $(MAXTEXT_SITE) $(MAXTEXT_PINS)
	touch $@

maxtext-peer: $(MAXTEXT_SITE)/.installed
	for t in $(MAXTEXT_PEER_TARGETS); do \
		if [ -n "$(MAXTEXT_PEER_OURS)" ] && [ ! -f $(MAXTEXT_PEER_OUT)/ours/$$t/compare.json ]; then \
			JAX_PLATFORMS=cpu $(BIN)/python -m farskip_jax inspect --config dsv2lite_farskip --mode train \
				--compare-regular --target $$t --no-timeline --out $(MAXTEXT_PEER_OUT)/ours/$$t || exit 1; fi; \
		JAX_PLATFORMS=cpu PYTHONPATH=$(MAXTEXT_SITE) $(BIN)/python bench/maxtext_peer.py --target $$t \
			--out $(MAXTEXT_PEER_OUT)/$$t --ours $(MAXTEXT_PEER_OUT)/ours/$$t $(MAXTEXT_PEER_FLAGS) || exit 1; \
	done

clean:
	rm -rf $(VENV)
