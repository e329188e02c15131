# Two commands do everything: `make serve` and `make test` (see README.md).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# CPU installs pin torch (a newer or unpinned torch pulls a multi-GB CUDA build); a torch already
# in the venv (e.g. a CUDA build on a GPU host) is kept.
TORCH_SPEC ?= torch==2.13.0
GEN    := services/common/gen/.built
PROTOS := $(wildcard protos/distserve/v1/*.proto)

.PHONY: serve test lint bench-engine bench-mesh bench-kvtransfer bench-handoff bench-tracing bench-planner bench-chaos bench-overload bench-conditional protos clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e '.[test]'
	touch $@

# gRPC stubs, generated from protos/ (never edited by hand).
$(GEN): $(PROTOS) services/common/build_protos.py $(STAMP)
	$(BIN)/python -m services.common.build_protos
	touch $@

protos: $(GEN)

serve: $(GEN)
	$(BIN)/distserve up

test: $(GEN)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench-engine: $(GEN)
	$(BIN)/python bench/engine/engine.py

bench-mesh: $(GEN)
	$(BIN)/python bench/mesh/mesh.py

bench-kvtransfer: $(GEN)
	$(BIN)/python bench/kvtransfer/kvtransfer.py

bench-handoff: $(GEN)
	$(BIN)/python bench/handoff/handoff.py

bench-tracing: $(GEN)
	$(BIN)/python bench/tracing/tracing.py

bench-conditional: $(GEN)
	$(BIN)/python bench/conditional/conditional.py

bench-planner: $(GEN)
	$(BIN)/python bench/planner/planner.py

bench-chaos: $(GEN)
	$(BIN)/python bench/chaos/chaos.py

bench-overload: $(GEN)
	$(BIN)/python bench/overload/overload.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache services/common/gen
