# Two entry points for a fresh clone; each sets up what it needs first.
#   make demo   - create .venv, install ddl, run the example on 4 ranks under ddlrun
#   make test   - create .venv (and .venv-mxnet for the MXNet tests, .venv-jax for the JAX
#                 tests, .venv-proto with the stub generator, .venv-floor with the oldest
#                 supported grpcio/protobuf), install ddl with the test tools, run the
#                 whole test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PYTEST_ARGS ?=
# Two pytest-xdist workers where the machine has two CPUs or more (one on a single CPU):
# much of the suite waits with a CPU idle. Tests of one module run on one worker;
# tests/conftest.py groups the modules that share a host-wide resource.
# PARALLEL=-n0 runs it in one process.
PARALLEL ?= -n logical --maxprocesses 2 --dist loadgroup

.PHONY: demo test setup setup-dev setup-test setup-mxnet setup-jax setup-proto setup-floor proto clean

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
# which tests/test_mxnet.py uses when it exists, on a Python that numpy 1.23.5 has wheels
# for (3.11 or older: the first found, MX_PYTHON=... to choose). Without one, the MXNet
# tests skip, saying why (.venv-mxnet/.unavailable).
MX_PYTHON ?= $(shell for p in $(PYTHON) python3.11 python3.10 $(wildcard $(HOME)/.pyenv/versions/3.1[01]*/bin/python3); do \
	"$$p" -c 'import sys; assert (3, 8) <= sys.version_info < (3, 12)' 2>/dev/null && { command -v "$$p"; break; }; done)
MXVENV ?= .venv-mxnet
$(MXVENV)/.installed: pyproject.toml
	@if [ -z "$(MX_PYTHON)" ]; then mkdir -p $(MXVENV); \
	  echo "no Python 3.8-3.11 found for MXNet 1.9 (numpy 1.23.5 has no wheels for newer ones; set MX_PYTHON)" > $(MXVENV)/.unavailable; \
	  echo "make: $$(cat $(MXVENV)/.unavailable): the MXNet tests will skip"; exit 0; fi; \
	rm -f $(MXVENV)/.unavailable; \
	$(MX_PYTHON) -m venv $(MXVENV) && \
	$(MXVENV)/bin/python -m pip install --quiet --upgrade pip && \
	$(MXVENV)/bin/python -m pip install --quiet -e '.[mxnet]' && \
	touch $@
setup-mxnet: $(MXVENV)/.installed

# JAX 0.11 and later need Python >= 3.12: JAX, optax and flax get their own environment on
# the first such Python found (JAX_PYTHON=... to choose), which tests/test_jax.py and
# tests/test_examples_jax.py use; without one they skip, saying why (.venv-jax/.unavailable). The main .venv stays on the default python3: the CPU
# build of torch the suite pins is there for it, where on 3.12 pip would take the CUDA
# build and some 3 GB of CUDA libraries.
JAX_PYTHON ?= $(shell for p in python3.12 python3.13 python3.14 $(wildcard $(HOME)/.pyenv/versions/3.1[234]*/bin/python3); do \
	"$$p" -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null && { command -v "$$p"; break; }; done)
JVENV ?= .venv-jax
$(JVENV)/.installed: pyproject.toml
	@if [ -z "$(JAX_PYTHON)" ]; then mkdir -p $(JVENV); \
	  echo "no Python >= 3.12 found for JAX >= 0.11 (set JAX_PYTHON)" > $(JVENV)/.unavailable; \
	  echo "make: $$(cat $(JVENV)/.unavailable): the JAX tests will skip"; exit 0; fi; \
	rm -f $(JVENV)/.unavailable; \
	$(JAX_PYTHON) -m venv $(JVENV) && \
	$(JVENV)/bin/python -m pip install --quiet --upgrade pip && \
	$(JVENV)/bin/python -m pip install --quiet -e '.[jaxdev]' && \
	touch $@
setup-jax: $(JVENV)/.installed

# The gRPC stub generator, pinned, in its own environment: the stubs in ddl/v1/ refuse a
# grpcio or protobuf older than the generator's, so they are made by the oldest generator
# whose stubs the newest runtimes accept and at whose versions ddl works. 1.80.0 writes
# protobuf 6.31.1 gencode (protobuf 7 runtimes accept it; tried up to 7.36.2) and grpc
# 1.80.0 gencode: with grpcio 1.78 and older, keepalive pings go unanswered while a
# process holds the GIL in a C call (tests/test_liveness.py fails), so 1.80.0 is ddl's
# own floor too. Wheels for CPython 3.9 to 3.14. It needs protobuf < 7, so it cannot live
# in .venv, where the suite runs on the newest protobuf.
# Moving this pin moves the floors in pyproject.toml (grpcio, protobuf) with it.
PROTO_GENERATOR := grpcio-tools==1.80.0
PVENV ?= .venv-proto
$(PVENV)/.installed: Makefile
	$(PYTHON) -m venv $(PVENV)
	$(PVENV)/bin/python -m pip install --quiet --upgrade pip
	$(PVENV)/bin/python -m pip install --quiet '$(PROTO_GENERATOR)'
	touch $@
setup-proto: $(PVENV)/.installed

# The oldest supported grpcio and protobuf (the >= floors in pyproject.toml, read from
# there) with ddl itself, editable and without its dependencies, on the oldest supported
# Python (requires-python) where this machine has one (FL_PYTHON=... to choose; else
# $(PYTHON)): tests/test_floor.py runs a job and the keepalive checks in it, so the
# floors are tested, not hoped for. The suite runs on the newest.
FLOOR_PINS = $(shell sed -n 's/^ *"\(grpcio\|protobuf\)>=\([0-9.]*\),.*/\1==\2/p' pyproject.toml)
FLOOR_PY := $(shell sed -n 's/^requires-python = ">=\([0-9.]*\)"/\1/p' pyproject.toml)
FL_PYTHON ?= $(or $(shell for p in python$(FLOOR_PY) $(wildcard $(HOME)/.pyenv/versions/$(FLOOR_PY).*/bin/python3); do \
	"$$p" -c 'import sys; assert "%d.%d" % sys.version_info[:2] == "$(FLOOR_PY)"' 2>/dev/null && { command -v "$$p"; break; }; done),$(PYTHON))
FLVENV ?= .venv-floor
$(FLVENV)/.installed: pyproject.toml Makefile
	rm -rf $(FLVENV)
	$(FL_PYTHON) -m venv $(FLVENV)
	$(FLVENV)/bin/python -m pip install --quiet --upgrade pip
	$(FLVENV)/bin/python -m pip install --quiet $(FLOOR_PINS) numpy ml_dtypes cloudpickle pytest pytest-timeout
	$(FLVENV)/bin/python -m pip install --quiet --no-deps -e .
	touch $@
setup-floor: $(FLVENV)/.installed

demo: $(VENV)/.installed
	$(BIN)/ddlrun -np 4 $(BIN)/python examples/numpy_allreduce.py

# Every environment the suite uses, without running it (.ci/run retries this step alone
# when a download breaks off).
setup-test: $(VENV)/.installed-dev $(MXVENV)/.installed $(JVENV)/.installed $(PVENV)/.installed \
		$(FLVENV)/.installed

test: setup-test
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest -q $(PARALLEL) $(PYTEST_ARGS)

# Regenerate the checked-in gRPC stubs from proto/ with the pinned generator (a test
# checks they are fresh).
proto: $(PVENV)/.installed
	$(PVENV)/bin/python -m grpc_tools.protoc -I proto --python_out=. --pyi_out=. \
		--grpc_python_out=. proto/ddl/v1/coordinator.proto

clean:
	rm -rf $(VENV) $(MXVENV) $(JVENV) $(PVENV) $(FLVENV) build dist *.egg-info
