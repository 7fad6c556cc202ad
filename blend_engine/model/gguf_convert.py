"""A GGUF file into a transformers model in one pass: its metadata read once with transformers'
fast header reader (no per-token Python objects), every tensor de-quantized with the `gguf`
package's vectorized numpy kernels straight from the memory-mapped file, and cast to the run dtype.

transformers' generic GGUF loader parses the whole file (vocabulary included) once for the config,
again for the tokenizer and again for the weights: about 25 s of the default model's 31 s first
start on 2 cores went there. The architectures whose config keys map one to one
(`_FAST_CONFIG_ARCHS`) take this path for their config; any other falls back to transformers'
config reader (slower, same result).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

_FAST_CONFIG_ARCHS = ("llama", "qwen2", "qwen3")


def _config_dict(gguf: Path) -> dict:
    """transformers' config dict for the file, from its metadata (string arrays left as counts)."""
    from transformers.integrations import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING
    from transformers.integrations.gguf import read_gguf_metadata

    metadata, tensor_names = read_gguf_metadata(str(gguf))
    arch = metadata["general.architecture"]
    name = str(metadata.get("general.name", ""))
    if arch not in _FAST_CONFIG_ARCHS or "mistral" in name.lower():
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        return load_gguf_checkpoint(str(gguf), return_tensors=False)["config"]
    config: dict = {"tie_word_embeddings": "output.weight" not in tensor_names}
    for key, value in metadata.items():
        prefix, _, rest = key.partition(".")
        target = GGUF_CONFIG_MAPPING.get(prefix, {}).get(rest)
        if target is None or target == -1:
            continue
        config[target] = value[0] if isinstance(value, list) and len(value) == 1 else value
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(arch, {}).items():
        config.setdefault(key, value)
    if "vocab_size" not in config and isinstance(metadata.get("tokenizer.ggml.tokens"), int):
        config["vocab_size"] = metadata["tokenizer.ggml.tokens"]  # the reader left the vocabulary as its count
    return config


def read_config(gguf: Path):
    """The model's transformers config."""
    from transformers import AutoConfig

    return AutoConfig.for_model(**_config_dict(gguf))


def read_tokenizer(gguf: Path):
    """The tokenizer the file describes (vocabulary, merges, special tokens, chat template)."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    return TokenizersBackend.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def _dequantized(blob: np.ndarray, start: int, info) -> np.ndarray:
    """One tensor as float32 in torch order (shape `info.shape`), from the mapped file."""
    from gguf import GGMLQuantizationType, dequantize

    qtype = GGMLQuantizationType(info.ggml_type)
    raw = blob[start:start + info.nbytes]
    if qtype is GGMLQuantizationType.F32:
        return raw.view(np.float32).reshape(info.shape)
    if qtype is GGMLQuantizationType.F16:
        return raw.view(np.float16).reshape(info.shape).astype(np.float32)
    rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
    return dequantize(raw.reshape(rows, -1), qtype).reshape(info.shape)


def _names(model, processor, header) -> dict[str, str]:
    """{GGUF tensor name: the model's parameter name}: one pass over the model's own names with gguf's
    name table (transformers' generic mapping walks every submodule's state dict, 6 s of CPU here);
    that mapping when a tensor of the file is left unnamed."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    arch = next((k for k, v in MODEL_ARCH_NAMES.items() if v == header.architecture), None)
    names: dict[str, str] = {}
    if arch is not None:
        table = get_tensor_name_map(arch, model.config.num_hidden_layers)
        for hf_name in model.state_dict():
            stem, dot, suffix = processor.preprocess_name(hf_name).rpartition(".")
            gguf_name = table.get_name(stem) if suffix in ("weight", "bias") and dot else None
            if gguf_name is not None:
                names[f"{gguf_name}.{suffix}"] = hf_name
    if all(info.name in names for info in header.tensors):
        return names
    return get_gguf_hf_weights_map(model, processor)


def _state_dict(gguf: Path, model, config: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of the file under the model's name for it, de-quantized and cast to `dtype`."""
    from transformers.integrations.gguf.reader import GgufHeader
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    header = GgufHeader.from_file(str(gguf))
    processor = TENSOR_PROCESSORS.get(header.architecture, TensorProcessor)(config=config)
    names = _names(model, processor, header)
    blob = np.memmap(gguf, dtype=np.uint8, mode="r")
    parsed: dict = {"config": config, "tensors": {}}
    out: dict[str, torch.Tensor] = {}
    for info in header.tensors:
        weights = _dequantized(blob, header.data_start + info.offset, info)  # float32, torch order
        result = processor.process(weights=weights, name=info.name, tensor_key_mapping=names, parsed_parameters=parsed)
        if result.name in names:
            out[names[result.name]] = torch.from_numpy(np.array(result.weights, dtype=np.float32)).to(dtype)
    return out


def read_model(gguf: Path, config, dtype: torch.dtype):
    """The model with the file's weights, in `dtype`, in eval mode."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    with no_init_weights():  # every weight is overwritten below: no random init (3 s of CPU here)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = _state_dict(gguf, model, config.to_dict(), dtype)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"{gguf.name}: weights missing {sorted(set(missing) - tied)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")
    model.tie_weights()
    return model.eval()
