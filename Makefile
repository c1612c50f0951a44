# Two entry points for a fresh clone; each sets up what it needs first.
#   make demo   - create .venv, install ddl, run the example on 4 ranks under ddlrun
#   make test   - create .venv (and .venv-mxnet for the MXNet tests), install ddl with the
#                 test tools, run the whole test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: demo test setup setup-dev setup-mxnet proto clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-dev: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@ $(VENV)/.installed

setup: $(VENV)/.installed
setup-dev: $(VENV)/.installed-dev

# MXNet 1.9.1 needs numpy < 1.24 (JAX and TensorFlow need numpy 2): its own environment,
# which tests/test_mxnet.py uses when it exists.
MXVENV ?= .venv-mxnet
$(MXVENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(MXVENV)
	$(MXVENV)/bin/python -m pip install --quiet --upgrade pip
	$(MXVENV)/bin/python -m pip install --quiet -e '.[mxnet]'
	touch $@
setup-mxnet: $(MXVENV)/.installed

demo: $(VENV)/.installed
	$(BIN)/ddlrun -np 4 $(BIN)/python examples/numpy_allreduce.py

test: $(VENV)/.installed-dev $(MXVENV)/.installed
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest -q $(PYTEST_ARGS)

# Regenerate the checked-in gRPC stubs from proto/ (a test checks they are fresh).
proto: $(VENV)/.installed-dev
	$(BIN)/python -m grpc_tools.protoc -I proto --python_out=. --pyi_out=. \
		--grpc_python_out=. proto/ddl/v1/coordinator.proto

clean:
	rm -rf $(VENV) $(MXVENV) build dist *.egg-info
