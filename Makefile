# Two commands set everything up on a fresh machine (Python >= 3.10 with venv and pip):
#   make train   -> creates .venv, installs zoo, trains DenseNet-BC-100 efficiently on built-in data
#   make test    -> creates .venv, installs zoo with its test extras, runs the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
TRAIN_ARGS ?= --model densenet --efficient True --dataset shapes --image_size 16 --epochs 3

.PHONY: train test install
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -e '.[dev]'
	touch $@

train: install
	$(PY) train.py $(TRAIN_ARGS)

test: install
	$(PY) -m pytest -q --durations=25
