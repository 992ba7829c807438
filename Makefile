# gpuplane: one Makefile drives every module of the workspace (./... does
# not cross module boundaries at a workspace root, so modules are listed).
SHELL := /bin/bash
GO ?= go
MODULES := contracts libs e2e $(sort $(wildcard services/*))
PKGS := $(addsuffix /...,$(addprefix ./,$(MODULES)))

.PHONY: test lint build schemas
test: lint
	$(GO) test -count=1 -timeout 15m $(PKGS)

lint:
	@out=$$(gofmt -l $(MODULES)); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet $(PKGS)

build:
	$(GO) build $(PKGS)

schemas:
	cd contracts && $(GO) run ./cmd/schemagen -out schema
