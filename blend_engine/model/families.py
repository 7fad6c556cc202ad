"""Which checkpoints can be blended exactly, and the per-family facts the layer loop needs.

A blend moves cached keys by composing RoPE rotations and recomputes a Llama-style layer
(`runner.ModelRunner`): model types with another layer, mixture-of-experts, latent attention,
soft-capping, or RoPE whose frequencies depend on the sequence length are refused with the
reason (`check_blendable`). Also here: the RoPE parameters and frequencies (computed by
transformers' own init functions) and the sliding window of each layer.
"""

from __future__ import annotations

import torch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# RoPE types whose frequencies do not depend on the sequence length: a cached key moved by
# composing rotations is exact. "dynamic" (NTK) and "longrope" change inv_freq with the length.
EXACT_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class UnsupportedModel(ValueError):
    """A checkpoint that cannot be blended exactly; the message names the type and the reason."""


# Model types refused with the reason (checked before the generic checks below).
_REFUSED_TYPES = {
    "gemma": "embeddings scaled by sqrt(hidden), (1 + weight) RMSNorm and GeGLU differ from the Llama layer",
    "gemma2": "attention logit soft-capping and extra pre/post feed-forward norms are not in the blend layer loop",
    "gemma3": "attention logit soft-capping/extra norms, per-head q/k norms with local-global RoPE are not "
              "in the blend layer loop",
    "gemma3_text": "extra pre/post feed-forward norms and local/global RoPE bases are not in the blend layer loop",
    "phi3": "fused qkv_proj / gate_up_proj weights (and usually longrope RoPE) are not supported",
    "mixtral": "mixture-of-experts MLP is not supported",
    "qwen2_moe": "mixture-of-experts MLP is not supported",
    "qwen3_moe": "mixture-of-experts MLP is not supported",
    "deepseek_v2": "multi-head latent attention (MLA, compressed KV) has no per-head K/V to move by RoPE",
    "deepseek_v3": "multi-head latent attention (MLA, compressed KV) has no per-head K/V to move by RoPE",
}


def rope_parameters(config) -> dict:
    """The config's RoPE parameters as one dict (`rope_parameters` in transformers 5,
    `rope_scaling` + `rope_theta` in older configs); rope_type "default" when unscaled."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(params)
    if "rope_type" not in params:
        params["rope_type"] = params.get("type", "default")
    return params


def check_blendable(config) -> None:
    """Refuse, with the model type or RoPE type and the reason, a config that cannot be blended
    exactly. Config-level only: no weights needed."""
    model_type = getattr(config, "model_type", "?")
    if model_type in _REFUSED_TYPES:
        raise UnsupportedModel(f"cannot blend model type {model_type!r}: {_REFUSED_TYPES[model_type]}")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModel(
            f"unsupported architecture {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    for attr in ("num_local_experts", "num_experts", "n_routed_experts"):
        if (getattr(config, attr, None) or 0) > 0:
            raise UnsupportedModel(f"cannot blend model type {model_type!r}: mixture-of-experts MLP ({attr}) "
                                   "is not supported")
    if getattr(config, "kv_lora_rank", None):
        raise UnsupportedModel(f"cannot blend model type {model_type!r}: multi-head latent attention (MLA)")
    for attr in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, attr, None):
            raise UnsupportedModel(f"cannot blend model type {model_type!r}: {attr} is not supported")
    rope_type = rope_parameters(config)["rope_type"]
    if rope_type in ("dynamic", "longrope"):
        raise UnsupportedModel(
            f"cannot blend RoPE type {rope_type!r} ({model_type}): its frequencies change with the sequence "
            "length, so a key cached at one length and moved to another position is not exact"
        )
    if rope_type not in EXACT_ROPE_TYPES:
        raise UnsupportedModel(f"cannot blend RoPE type {rope_type!r} ({model_type}); supported: "
                               f"{', '.join(EXACT_ROPE_TYPES)}")
    for kind in getattr(config, "layer_types", None) or ():
        if kind not in ("full_attention", "sliding_attention"):
            raise UnsupportedModel(f"cannot blend model type {model_type!r}: layer type {kind!r}")


def layer_windows(config) -> tuple[int | None, ...]:
    """Per layer, the sliding attention window (a token sees itself and the window-1 before it),
    or None for full attention. Mistral: one window for every layer; Qwen2/3: `layer_types`."""
    window = getattr(config, "sliding_window", None)
    n = config.num_hidden_layers
    kinds = getattr(config, "layer_types", None)
    if not window:
        return (None,) * n
    if kinds:
        return tuple(window if k == "sliding_attention" else None for k in kinds)
    return (int(window),) * n


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_frequencies(config, rotary, device) -> tuple[torch.Tensor, float]:
    """(inv_freq [D/2] fp32, attention scaling) from transformers' own RoPE init functions, so
    every exact RoPE type (default, linear, llama3, yarn) is computed as transformers does."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = rope_parameters(config)["rope_type"]
    if rope_type == "default":
        inv_freq, scale = type(rotary).compute_default_rope_parameters(config)
    else:
        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, device)
    return inv_freq.to(device=device, dtype=torch.float32).clone(), float(scale or 1.0)
