# flaxtpu: the commands the README documents. Each target sets up what it needs itself:
# a project virtualenv in $(VENV) with flaxtpu installed (once; again when pyproject.toml changes).
PYTHON ?= python3
VENV ?= .venv
RUN := $(VENV)/bin/python
CONFIG ?= configs/digits.py
WORKDIR ?= runs/digits
# --mode=export's model.onnx (flaxtpu/exporters/onnx_export.py). --no-deps: jax2onnx's metadata pins
# orbax-checkpoint<0.11.37 (a downgrade) and pulls equinox, dm-pix, netron, orbax-export, none of which the
# converter imports; its real dependencies are the `onnx` extra. Pinned: flaxtpu patches its internals.
JAX2ONNX := jax2onnx==0.17.1

.PHONY: install test test-slow train eval lint bench

$(VENV)/.installed: pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "error: flaxtpu needs Python 3.10+; run make PYTHON=python3.11 (or another 3.10+)")'
	@test -x $(RUN) || $(PYTHON) -m venv $(VENV) || (echo "error: $(PYTHON) -m venv failed; install the venv module (e.g. apt install python3-venv)" >&2; exit 1)
	$(RUN) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	@if $(RUN) -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then \
	  $(RUN) -m pip install --quiet --disable-pip-version-check --no-deps '$(JAX2ONNX)'; \
	else echo "note: jax2onnx needs Python 3.11+; --mode=export will write no model.onnx"; fi
	@touch $@

install: $(VENV)/.installed

test: install
	$(RUN) -m pytest -q -n 2 --durations=25

test-slow: install  # accuracy runs on real CIFAR-10: FLAXTPU_CIFAR10=/path/to/cifar10 (tens of minutes)
	$(RUN) -m pytest -q -m slow

train: install  # the embedded digits: no download, about a minute on 2 cores
	$(RUN) -m flaxtpu.main --config=$(CONFIG) --workdir=$(WORKDIR)

eval: install  # the config comes from the trained run in WORKDIR
	$(RUN) -m flaxtpu.main --workdir=$(WORKDIR) --mode=eval

lint: install
	$(RUN) -m ruff check flaxtpu configs experiments tests benchmarks

$(VENV)/.installed-bench: $(VENV)/.installed
	$(RUN) -m pip install --quiet --disable-pip-version-check -e '.[test,bench]'
	@touch $@

bench: $(VENV)/.installed-bench  # results go to benchmarks/results/local/ (the committed ones stay)
	$(RUN) -m benchmarks.run_all
