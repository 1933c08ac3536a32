# flaxtpu: the commands the README documents. Each target sets up what it needs itself, in one project
# virtualenv in $(VENV) (again when pyproject.toml or this file changes), one stamp file per layer:
#   train, eval, install  flaxtpu's runtime dependencies only ($(VENV)/.installed-runtime)
#   install-onnx          + --mode=export's ONNX converter: the `onnx` extra and jax2onnx (.installed-onnx)
#   test, test-quick, test-slow, lint  + the `test` extra: torch, timm, wandb, selenium, ... (.installed-test)
#   bench                 + the `bench` extra: the peers, PyTorch and Keras (.installed-bench)
# Each layer builds on the one before, so `make test` after `make train` adds the extras to the same .venv.
# --no-compile: no .pyc for the thousands of modules nothing imports (TensorFlow's); Python writes those a
# run imports on first use. A fresh clone's `make train`: about a minute here, install included (README).
PYTHON ?= python3
VENV ?= .venv
RUN := $(VENV)/bin/python
PIP := $(RUN) -m pip install --quiet --disable-pip-version-check --no-compile
CONFIG ?= configs/digits.py
WORKDIR ?= runs/digits
# --mode=export's model.onnx (flaxtpu/exporters/onnx_export.py). --no-deps: jax2onnx's metadata pins
# orbax-checkpoint<0.11.37 (a downgrade) and pulls equinox, dm-pix, netron, orbax-export, none of which the
# converter imports; its real dependencies are the `onnx` extra. Pinned: flaxtpu patches its internals.
JAX2ONNX := jax2onnx==0.17.1

.PHONY: install install-onnx test test-quick test-slow train eval lint bench

$(VENV)/.installed-runtime: pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "error: flaxtpu needs Python 3.10+; run make PYTHON=python3.11 (or another 3.10+)")'
	@test -x $(RUN) || $(PYTHON) -m venv $(VENV) || (echo "error: $(PYTHON) -m venv failed; install the venv module (e.g. apt install python3-venv)" >&2; exit 1)
	$(PIP) -e .
	@touch $@

$(VENV)/.installed-onnx: $(VENV)/.installed-runtime
	$(PIP) -e '.[onnx]'
	@if $(RUN) -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then \
	  $(PIP) --no-deps '$(JAX2ONNX)'; \
	else echo "note: jax2onnx needs Python 3.11+; --mode=export will write no model.onnx"; fi
	@touch $@

$(VENV)/.installed-test: $(VENV)/.installed-onnx
	$(PIP) -e '.[onnx,test]'
	@touch $@

$(VENV)/.installed-bench: $(VENV)/.installed-test
	$(PIP) -e '.[onnx,test,bench]'
	@touch $@

install: $(VENV)/.installed-runtime

install-onnx: $(VENV)/.installed-onnx  # then --mode=export also writes model.onnx (make test installs it too)

train: $(VENV)/.installed-runtime  # the embedded digits: no download, about a minute on 2 cores
	$(RUN) -m flaxtpu.main --config=$(CONFIG) --workdir=$(WORKDIR)

eval: $(VENV)/.installed-runtime  # the config comes from the trained run in WORKDIR
	$(RUN) -m flaxtpu.main --workdir=$(WORKDIR) --mode=eval

# --dist loadfile: a file's tests run in one worker, so each module-scoped fixture (a trained run shared by a
# file's tests) is built once, not once in each worker.
test: $(VENV)/.installed-test  # everything but the slow accuracy runs (DEVELOPING.md)
	$(RUN) -m pytest -q -n 2 --dist loadfile --durations=25

test-quick: $(VENV)/.installed-test  # the tests marked `quick` in tests/conftest.py: a few minutes
	$(RUN) -m pytest -q -n 2 -m 'quick and not slow' --durations=10

test-slow: $(VENV)/.installed-test  # accuracy runs on real CIFAR-10: FLAXTPU_CIFAR10=/path/to/cifar10 (tens of minutes)
	$(RUN) -m pytest -q -m slow

lint: $(VENV)/.installed-test
	$(RUN) -m ruff check flaxtpu configs experiments tests benchmarks

bench: $(VENV)/.installed-bench  # results go to benchmarks/results/local/ (the committed ones stay)
	$(RUN) -m benchmarks.run_all
