# flaxtpu: the commands the README documents.
PYTHON ?= python
WORKDIR ?= runs/cifar10
CONFIG ?= configs/cifar10.py
CIFAR10 ?= ../shared/datasets/cifar10

.PHONY: install test test-slow train eval lint bench

install:
	$(PYTHON) -m pip install -e '.[test]'

test:
	$(PYTHON) -m pytest -q -n 2

test-slow:  # accuracy runs on real CIFAR-10 (tens of minutes on 2 cores)
	$(PYTHON) -m pytest -q -m slow

train:
	$(PYTHON) -m flaxtpu.main --config=$(CONFIG) --workdir=$(WORKDIR) --config.dataset.folder=$(CIFAR10)

eval:
	$(PYTHON) -m flaxtpu.main --config=$(CONFIG) --workdir=$(WORKDIR) --config.dataset.folder=$(CIFAR10) --mode=eval

lint:
	$(PYTHON) -m ruff check flaxtpu configs experiments tests benchmarks

bench:
	$(PYTHON) benchmarks/run_all.py
