# Two commands set everything up on a fresh machine (Python >= 3.10 with venv and pip):
#   make train   -> creates .venv, installs zoo, trains DenseNet-BC-100 efficiently on built-in data
#   make test    -> creates .venv, installs zoo with its test extras, runs the fast lane: every
#                   test not marked slow (under 10 minutes on 2 cores; before every commit)
#   make test-all -> the whole suite, slow tests included (under 35 minutes on 2 cores; CI)
# Both run on WORKERS pytest processes (pytest-xdist; default 2, one torch thread each):
# `make test WORKERS=8` on a larger machine, `WORKERS=0` for one process.
# and for the project's own checks:
#   make hooks          -> git refuses commit subjects over 72 characters (.githooks/commit-msg)
#   make docs           -> the docs site with the API reference (site/), warnings as errors
#   make package-check  -> builds the wheel and sdist, installs the wheel in a fresh environment
#                          outside the checkout, trains one tiny epoch with `zoo-train`, make docs
VENV ?= .venv
PY := $(VENV)/bin/python
WORKERS ?= 2
PARALLEL := $(if $(filter 0,$(WORKERS)),,-n $(WORKERS) --dist worksteal)
TRAIN_ARGS ?= --model densenet --efficient True --dataset shapes --image_size 16 --epochs 3

.PHONY: train test test-all install docs package-check hooks
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -e '.[dev]'
	touch $@

train: install
	$(PY) train.py $(TRAIN_ARGS)

test: install
	$(PY) -m pytest -q $(PARALLEL) -m "not slow" --durations=25

test-all: install
	$(PY) -m pytest -q $(PARALLEL) --durations=25

$(VENV)/.docs-installed: $(VENV)/.installed
	$(VENV)/bin/pip install -e '.[dev,docs]'
	touch $@

docs: $(VENV)/.docs-installed
	$(VENV)/bin/mkdocs build --strict --site-dir site

package-check: install
	bash .ci/package_check.sh $(VENV)

hooks:
	git config core.hooksPath .githooks
