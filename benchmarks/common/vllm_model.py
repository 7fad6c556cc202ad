"""`python -m benchmarks.common.vllm_model`: the bundled SmolLM2 as a Hugging Face folder for vLLM
(`blend_engine.model.hf_folder`, which `make run-vllm` uses too), under `BLENDSERVE_MODEL_CACHE_DIR` when set.

The folder the vLLM peer (`peers.peer_vllm`) and the hand-over (`vllm_decoder.vllm_handover`) serve;
`make bench-peer-vllm-install` writes it ahead, and docker-compose.vllm.yml points at the command."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from blend_engine.model import hf_folder


def ensure_model_folder(gguf: Path | None = None, root: Path | None = None) -> Path:
    env = os.environ.get("BLENDSERVE_MODEL_CACHE_DIR")
    return hf_folder.ensure_model_folder(gguf, root or (Path(env) if env else None))


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    print(ensure_model_folder())


if __name__ == "__main__":
    main()
