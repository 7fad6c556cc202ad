"""Model access: a causal LM exposed one layer at a time.

Every transformers-internal detail lives here and in `files` (where weights come from:
GGUF, checkpoint folders, the cache of de-quantized weights) and `families` (which checkpoints
can be blended exactly, RoPE parameters, sliding windows). The rest of the engine sees a
`ModelRunner` that can embed tokens, produce one layer's Q/K/V for some tokens at explicit
positions, finish a layer (o_proj + MLP) for those tokens, rotate cached keys, and map the final
hidden state to logits.

Shape vocabulary used in comments: L layers, T tokens, S selected tokens, N context tokens,
Hq query heads, H kv heads, D head dim, E hidden size, V vocab.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from blend_engine.model import cpu_kernels
from blend_engine.model.families import check_blendable, layer_windows, rope_frequencies, rotate_half
from blend_engine.model.files import DEFAULT_MODEL, _load_hf, pick_device, pick_dtype, pick_linear_dtype
from blend_engine.model.packed import ROWS as PACKED_ROWS
from blend_engine.model.packed import PackedWeight, pack_linears

logger = logging.getLogger(__name__)

__all__ = ["KV_LAYOUT_VERSION", "ModelRunner", "ModelShape"]

KV_LAYOUT_VERSION = 1

# SDPA's kernels a CUDA runner may pick. Not cuDNN's: it builds an execution plan per new shape, and
# every decode step (and every request) has a new key length: measured on an H200, a decode step over
# 8K tokens of the 8B shape at growing positions took 99.9 ms with cuDNN eligible, 36.4 ms with it
# excluded (benchmarks/gpu_decode_profile.py, results/gpu/sdpa_ab). None: whatever torch picks.
CUDA_SDPA_BACKENDS: tuple | None = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")

# The fp32 row counts at which a CPU linear layer runs as (W @ x^T)^T instead of x @ W^T (`rows_linear`).
# torch's CPU sgemm for x @ W^T at a few rows costs up to 2.5x the weights' read. Measured on the dev
# host (AMD EPYC, AVX2, 2 threads), SmolLM2-135M's 211 projections (30 layers + lm_head), three runs:
# 2 rows 81-85 ms as x @ W^T against 32 ms as W @ x^T; 8 rows 73-76 against 52-53; 64 rows 164-197
# against 153-157; 96 rows 217-261 against 201-230; at 128 rows the two are even and from 192 x @ W^T
# wins. One row goes in twice, W @ [x; x]^T: x @ W^T takes a matrix-vector kernel on one core (48 ms
# for the 211 projections on the fresh EPYC host, AVX-512) against 19 ms on both. (It once looked worse
# in the service: that was libgomp's throttled spinning, `cpu_threads`.) Past 8 rows, a count that is not
# a multiple of 8 takes a much slower path in MKL: 15 rows 115 ms against 63 as 16, 31 rows 133 against
# 81 as 32 (9 rows 55 against 59, the one loss; benchmarks/results/cpu_threads/rows.txt), so those are
# padded with zero rows (`padded_rows`). Decode steps are in this range, prefills not.
SMALL_ROWS = range(1, 97)
# The families' RMSNorm classes (`families.SUPPORTED_MODEL_TYPES`): w * (x / sqrt(mean(x^2) + eps)), as
# `cpu_kernels.rms_norm` computes it.
RMS_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})
# The most bytes one MLP intermediate [rows, I] takes on the CPU (`finish_layer` splits longer runs of rows).
# glibc maps every block past its mmap ceiling (32 MB on 64-bit) afresh and unmaps it when freed, so each
# layer over all of a 6K prompt (SmolLM2: 5,839 x 1,536 floats, 36 MB an intermediate) faulted its four
# intermediates in page by page again: a 6K full prefill took ~1.1M minor faults, a 6K blend (whose first
# layers take every row) ~40K more than needed; each fault dearer still beside a resident vLLM, whose memory
# takes the warm pages (benchmarks/results/peer_vllm/2026-12-06_pool_prefault). A quarter of the ceiling:
# glibc also trims a freed heap top past twice the largest block freed, and 12 MB parts still faulted 77K
# pages in one of two runs, 6-8 MB parts < 1K. Measured here (2 cores, AVX-512;
# benchmarks/results/cpu_kernels/mlp_rows_2026-12-07.txt): the 6K full prefill 10.95-11.09 s -> 9.99-10.35 s,
# 1-17K faults; the pair's reordered 6K blend, recompute 3.30-3.79 s -> 3.00-3.33 s.
MLP_PART_BYTES = 8 << 20


@dataclass(frozen=True)
class ModelShape:
    n_layers: int
    n_heads: int  # Hq
    n_kv_heads: int  # H
    head_dim: int  # D
    hidden: int  # E
    vocab: int
    max_positions: int

    @classmethod
    def of(cls, cfg) -> ModelShape:
        """The shape a transformers config gives (D: its head_dim, else hidden size over query heads)."""
        return cls(
            n_layers=cfg.num_hidden_layers,
            n_heads=cfg.num_attention_heads,
            n_kv_heads=cfg.num_key_value_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            hidden=cfg.hidden_size,
            vocab=cfg.vocab_size,
            max_positions=cfg.max_position_embeddings,
        )


class ModelRunner:
    """A causal LM exposed layer by layer. Holds no per-request state."""

    def __init__(self, model, tokenizer, name: str = "custom", linear_dtype: torch.dtype | None = None,
                 packed: bool = True, packed_rows: range | None = None, float_rows: range | None = None) -> None:
        """`linear_dtype` (`files.pick_linear_dtype`): the projections and lm_head run on copies of
        their weights in this dtype (inputs cast to it, outputs back); norms, RoPE, K/V and attention
        keep the model's dtype. The model's own weights stay: transformers' forward runs them to precompute
        every stored passage, so stored K/V and the fingerprint do not depend on this setting.
        `packed`: a float32 model on the CPU keeps each projection weight that was de-quantized from a
        block code (a GGUF's Q4_1 / Q8_0) in that code too, for steps of `packed.ROWS` rows (`linear`):
        the same outputs bit for bit from a fifth of the bytes. `packed_rows`: the row counts that
        run on those codes; None = measured here once (`measured_packed_rows`), as the crossover with MKL's
        sgemm differs between machines several fold. `float_rows`: the same for the float32 kernel over the
        projections kept as float32 weights only (a checkpoint folder's); None = measured here once where
        they are large enough to time (`measured_float_rows`), else `cpu_kernels.ROWS`."""
        check_blendable(model.config)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        inner = model.model
        self._layers, self._embed, self._norm, self._lm_head = inner.layers, inner.embed_tokens, inner.norm, model.lm_head
        self.shape = ModelShape.of(model.config)
        self.scaling = self.shape.head_dim**-0.5
        self.device = next(model.parameters()).device
        # RoPE tables from our own copy of inv_freq: never mutated, so worker threads share it safely
        self._inv_freq, self._rope_scale = rope_frequencies(model.config, inner.rotary_emb, self.device)  # [D/2], float
        self.windows = layer_windows(model.config)  # per layer: sliding window or None
        self.dtype = next(model.parameters()).dtype
        self.linear_dtype = linear_dtype
        cpu_f32 = linear_dtype is None and self.device.type == "cpu" and self.dtype == torch.float32
        self._weights, self._packed = _linear_weights([*inner.layers.modules(), self._lm_head], linear_dtype,
                                                      packed and cpu_f32)
        self.packed_rows = PACKED_ROWS if not self._packed else \
            packed_rows if packed_rows is not None else measured_packed_rows(list(inner.layers.modules()), self._packed)
        self.float_rows = float_rows if float_rows is not None or not cpu_f32 else \
            measured_float_rows(list(inner.layers.modules()), self._packed)
        self.mlp_rows = mlp_part_rows(inner.layers[0].mlp, self.dtype, linear_dtype) if self.device.type == "cpu" \
            else None  # a device's caching allocator keeps freed blocks: one call
        self.fingerprint = self._fingerprint()
        self.eos_token_ids = self._eos_ids()
        self.sdpa_backends = _sdpa_backends(CUDA_SDPA_BACKENDS) if self.device.type == "cuda" else None
        # norms, RoPE and placement through `cpu_kernels` (float32 on the CPU): `norm`, `rotate`, `placement.Placer`
        self.uses_cpu_kernels = self.device.type == "cpu" and self.dtype == torch.float32 and cpu_kernels.ensure()
        # every row of a long prompt attends on SDPA's causal kernel from this many rows (None: on the C++ kernel)
        self.sdpa_causal_rows = measured_causal_rows(self)

    # ----------------------------------------------------------------- construction
    @classmethod
    def load(cls, spec: str = DEFAULT_MODEL, device: str | None = None, dtype: str | None = None,
             cache_dir: Path | None = None, linear_dtype: str | None = None, packed: bool = True) -> ModelRunner:
        """The model `spec` on `device` in `dtype`; a GGUF file is prepared once into `cache_dir`
        (default `files.DEFAULT_CACHE_ROOT`). `linear_dtype`, `packed`: see `__init__`."""
        dev = pick_device(device)
        dt = pick_dtype(dev, dtype)
        low = pick_linear_dtype(dev, dt, linear_dtype)  # before the load: a refused setting costs nothing
        model, tok = _load_hf(spec, dt, cache_dir)
        return cls(model.to(dev), tok, name=spec or DEFAULT_MODEL, linear_dtype=low, packed=packed)

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
        if self.windows[layer] is None:
            return None
        allowed = self.allowed_keys(layer, q_pos, n_keys)  # [S, n]
        return torch.zeros(allowed.shape, dtype=self.dtype, device=self.device).masked_fill_(~allowed, float("-inf"))

    def allowed_keys(self, layer: int, q_pos: torch.Tensor, n_keys: int) -> torch.Tensor:
        """Which keys 0..n_keys-1 the queries at absolute positions q_pos [S] see at this layer:
        [S, n_keys] bool, j <= q, and q - window < j on a sliding-window layer."""
        q = q_pos.to(self.device).view(-1, 1)  # [S, 1]
        j = torch.arange(n_keys, device=self.device).view(1, -1)  # [1, n]
        window = self.windows[layer]
        return (j <= q) if window is None else (j <= q) & (j > q - window)  # [S, n]

    def window_masks(self, q_pos: torch.Tensor, n_keys: int) -> Callable[[int], torch.Tensor | None]:
        """`window_mask` for these queries at any layer, built once per window size: the layers of a
        pass (or of one selection set) share them instead of building one per layer."""
        built: dict[int, torch.Tensor] = {}

        def mask(layer: int) -> torch.Tensor | None:
            window = self.windows[layer]
            if window is not None and window not in built:
                built[window] = self.window_mask(layer, q_pos, n_keys)  # [S, n_keys]
            return None if window is None else built[window]

        return mask

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
        x = self.norm(self._layers[layer].input_layernorm, hidden)  # [T, E]
        T = x.shape[0]
        D = self.shape.head_dim
        q = self.linear(attn.q_proj, x).view(T, -1, D)  # [T, Hq, D]
        k = self.linear(attn.k_proj, x).view(T, -1, D)  # [T, H, D]
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm per head over D, before RoPE
            q, k = self.norm(attn.q_norm, q), self.norm(attn.k_norm, k)  # [T, Hq, D], [T, H, D]
        q, k = q.transpose(0, 1), k.transpose(0, 1)  # [Hq, T, D], [H, T, D]
        v = self.linear(attn.v_proj, x).view(T, -1, D).transpose(0, 1)  # [H, T, D]
        return self.rotate(q, cos, sin), self.rotate(k, cos, sin), v  # [Hq, T, D], [H, T, D], [H, T, D]

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`apply_rotation` of fresh rows x [H, T, D] with tables [T, D]: on the CPU in float32 one pass of
        `cpu_kernels.rope` (the same values bit for bit), else torch's ops."""
        if self.uses_cpu_kernels and cos.dtype == x.dtype == torch.float32 and cos.shape == x.shape[1:] \
                and not _needs_grad(x):
            return cpu_kernels.rope(x, cos, sin)  # [H, T, D]
        return self.apply_rotation(x, cos, sin)  # [H, T, D]

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
        with _sdpa_kernels(self.sdpa_backends):
            out = torch.nn.functional.scaled_dot_product_attention(
                q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                attn_mask=None if mask is None else mask.view(1, 1, *mask.shape),
                is_causal=causal and mask is None,
                scale=self.scaling,
                enable_gqa=gqa,
            )  # [1, Hq, S, D]
        return out[0].transpose(0, 1).reshape(q.shape[1], -1)  # [S, Hq*D]

    def causal_on_sdpa(self, layer: int, n: int) -> bool:
        """Whether all n rows of a prompt attend at `layer` through `attend(causal=True)` rather than
        `cpu_kernels.selected_attention`: from `sdpa_causal_rows` rows, never on a sliding-window layer
        (SDPA would take a mask there, and its slow path)."""
        return self.sdpa_causal_rows is not None and n >= self.sdpa_causal_rows and self.windows[layer] is None

    def attend_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Batched attention, one call: q [B, H, G, D] (each KV head's G query rows) over k, v
        [B, H, N, D], mask [B, 1, 1, N] bool (True = may attend). Returns [B, H, G, D]."""
        with _sdpa_kernels(self.sdpa_backends):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling)

    def finish_layer(self, layer: int, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual + o_proj, then the MLP block. hidden, result: [S, E]; attn_out: [S, Hq*D]. On the CPU
        more than `mlp_rows` rows go through in equal parts of at most that many (`MLP_PART_BYTES`), each
        row's values as in one call (a row of a product does not depend on the others; bit for bit on MKL here)."""
        S = hidden.shape[0]
        if self.mlp_rows is None or S <= self.mlp_rows or torch.is_grad_enabled():  # (out= has no backward)
            return self._finish_rows(layer, hidden, attn_out)  # [S, E]
        out = torch.empty_like(hidden)  # [S, E]
        part = -(-S // -(-S // self.mlp_rows))  # equal parts, each <= mlp_rows
        for s in range(0, S, part):
            self._finish_rows(layer, hidden[s:s + part], attn_out[s:s + part], out[s:s + part])  # [part, E]
        return out

    def _finish_rows(self, layer: int, hidden: torch.Tensor, attn_out: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """`finish_layer` of rows hidden [S, E], attn_out [S, Hq*D], into `out` [S, E] when given."""
        blk = self._layers[layer]
        h = hidden + self.linear(blk.self_attn.o_proj, attn_out)  # [S, E]
        return torch.add(h, self._mlp(blk.mlp, self.norm(blk.post_attention_layernorm, h)), out=out)  # [S, E]

    def _mlp(self, mlp, x: torch.Tensor) -> torch.Tensor:
        """The gated MLP of every supported family, down(act(gate(x)) * up(x)): x, result [S, E]."""
        gate = self.linear(mlp.gate_proj, x)  # [S, I]
        return self.linear(mlp.down_proj, mlp.act_fn(gate) * self.linear(mlp.up_proj, x))  # [S, E]

    def norm(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """module(x) for x [..., E]: one of the families' RMSNorms (`RMS_NORMS`) runs on the CPU in float32
        as one pass a row of `cpu_kernels.rms_norm` (torch: six ops over every row; the same values to
        float32 rounding), anything else as the module."""
        if self.uses_cpu_kernels and type(module).__name__ in RMS_NORMS and x.dtype == torch.float32 \
                and not _needs_grad(x, module.weight):
            return cpu_kernels.rms_norm(x, module.weight, module.variance_epsilon)  # [..., E]
        return module(x)

    def linear(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """layer(x) for x [T, in]: [T, out], through the weight's `linear_dtype` copy when there is one
        (x cast to it, the product cast back), its block code for a few rows (`packed`), else
        `rows_linear`."""
        w = self._weights.get(id(layer))
        if w is None:
            return rows_linear(layer, x, self._packed.get(id(layer)), self.packed_rows, self.float_rows)
        out = torch.nn.functional.linear(x.to(w.dtype), w).to(x.dtype)  # [T, out]
        return out if layer.bias is None else out + layer.bias  # [T, out]

    def prefill_cache(self, ids: torch.Tensor, mask: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A batch of right-padded sequences [B, T] (mask [B, T], 1 = real) through the model's own
        forward; per layer (k after RoPE, v), each [B, H, T, D]. Used to precompute many chunks."""
        with _sdpa_kernels(self.sdpa_backends):
            out = self.model.model(input_ids=ids, attention_mask=mask, use_cache=True)
        cache = out.past_key_values
        return [(layer.keys, layer.values) for layer in cache.layers]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(self._lm_head, self.norm(self._norm, hidden)).float()  # [S, V]


PROBE_ROWS = (16, 24, 32, 40, 48, 64, 96, 128, 160, 192, 224)  # row counts `packed_rows_limit` tries


def best_time(fn: Callable[[], object], reps: int = 5) -> float:
    """fn's fastest of `reps` timed calls (after one untimed), in seconds."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def first_faster(probes: tuple[int, ...], faster: list[bool]) -> int:
    """The first probe from which the other op was faster there and at the next probe too (one noisy
    probe moves nothing); past the last probe when none is."""
    for i, n in enumerate(probes):
        if faster[i] and (i + 1 == len(faster) or faster[i + 1]):
            return n
    return probes[-1] + 1


def packed_rows_limit(layer: torch.nn.Linear, code: PackedWeight,
                      timer: Callable[[Callable[[], object]], float] = best_time) -> int:
    """The fewest rows (of `PROBE_ROWS`, `first_faster`) from which MKL's sgemm over `layer`'s float32
    weight beats `cpu_kernels.packed_linear` over its block code on this machine.

    The kernel reads a fifth of the bytes, which wins while a product is bound by reading the weight
    (decode steps); with more rows it is bound by arithmetic, where MKL's tiles are faster: from ~256
    rows on the machine `packed.ROWS` was measured on, from 24-48 on an AVX-512 Xeon (SmolLM2's MLP
    projection at 96 rows: 807 us on the codes against 515 on MKL)."""
    return mkl_takes_over(layer, lambda x: cpu_kernels.packed_linear(x, code.codes, code.d, code.m, layer.bias),
                          PROBE_ROWS, timer)


def mkl_takes_over(layer: torch.nn.Linear, kernel: Callable[[torch.Tensor], torch.Tensor], probes: tuple[int, ...],
                   timer: Callable[[Callable[[], object]], float]) -> int:
    """The fewest of `probes` rows (`first_faster`) from which MKL's sgemm over `layer`'s float32 weight
    (`F.linear`) beats `kernel(x)` for x [rows, in], timing the kernel then MKL at each probe."""
    faster = []
    for n in probes:
        x = torch.randn(n, layer.in_features)  # [T, in]
        own = timer(lambda x=x: kernel(x))
        mkl = timer(lambda x=x: torch.nn.functional.linear(x, layer.weight, layer.bias))
        faster.append(mkl < own)
    return first_faster(probes, faster)


FLOAT_PROBES = tuple(n for n in PROBE_ROWS if n < cpu_kernels.ROWS.stop)  # `float_rows_limit`'s row counts
FLOAT_PROBE_MIN = 1 << 16  # weights with fewer elements (tiny test models) are not timed (`measured_causal_rows` too)


def float_rows_limit(layer: torch.nn.Linear, timer: Callable[[Callable[[], object]], float] = best_time) -> int:
    """The fewest rows (of `FLOAT_PROBES`, `first_faster`) from which MKL's sgemm (`F.linear`) beats
    `cpu_kernels.rows_linear` over `layer`'s float32 weight here: past `cpu_kernels.ROWS` where it never
    does (the host the kernel was measured on); from ~32 rows on an AVX-512 Xeon (SmolLM2's MLP projection
    at 96 rows: 707-746 us on the kernel, 463-500 on MKL, 605-680 as `mkl_rows`' transposed product)."""
    return mkl_takes_over(layer, lambda x: cpu_kernels.rows_linear(x, layer.weight, layer.bias), FLOAT_PROBES, timer)


def measured_float_rows(modules: list[torch.nn.Module], packed: dict[int, PackedWeight]) -> range | None:
    """The row counts the float32 kernel runs for projections without a block code: `cpu_kernels.ROWS`
    below `float_rows_limit` of the largest such projection. None (`cpu_kernels.ROWS` as it is at each
    call) where there is none, it is too small to time (`FLOAT_PROBE_MIN`) or the kernels cannot run."""
    plain = [m for m in modules if type(m) is torch.nn.Linear and id(m) not in packed
             and m.weight.dtype == torch.float32]
    if not plain or not cpu_kernels.ensure():
        return None
    layer = max(plain, key=lambda m: m.weight.numel())
    if layer.weight.numel() < FLOAT_PROBE_MIN:
        return None
    with torch.no_grad():
        limit = min(float_rows_limit(layer), cpu_kernels.ROWS.stop)
    logger.info("float32 projections of %d-%d rows run on the CPU kernel, more on MKL (measured here)",
                cpu_kernels.ROWS.start, limit - 1)
    return range(cpu_kernels.ROWS.start, limit)


CAUSAL_PROBE = 3072  # the prompt length `sdpa_causal_faster` times both kernels at


def sdpa_causal_faster(runner: ModelRunner, rows: int = CAUSAL_PROBE,
                       timer: Callable[[Callable[[], object]], float] | None = None) -> bool:
    """Whether SDPA's causal kernel (`ModelRunner.attend`) attends every row of a `rows`-token prompt at the
    runner's heads faster than `cpu_kernels.selected_attention` on this machine. Which one is differs by
    host and kernel: on an AMD EPYC (AVX-512) the C++ kernel was 1.16-1.20x faster; on an Intel Xeon
    (AVX-512, AMX) SDPA was, from ~2K rows, 1.20-1.22x at 4-8K (SmolLM2's heads at 5,839 rows: 216 against
    176 ms a layer), until the kernel's inner loops lost two uops a broadcast (738c7c7): now 142 against
    167 ms there, the kernel 1.18x."""
    timer = timer or functools.partial(best_time, reps=2)  # ~0.3 s at SmolLM2's heads
    s = runner.shape
    g = torch.Generator().manual_seed(0)
    q = torch.randn(s.n_heads, rows, s.head_dim, generator=g)  # [Hq, T, D]
    k = torch.randn(s.n_kv_heads, rows, s.head_dim, generator=g)  # [H, T, D]
    v = torch.randn(s.n_kv_heads, rows, s.head_dim, generator=g)  # [H, T, D]
    pos = torch.arange(rows)  # [T]
    own = timer(lambda: cpu_kernels.selected_attention(q, k, v, pos, None, runner.scaling))
    sdpa = timer(lambda: runner.attend(q, k, v, None, causal=True))
    return sdpa < own


def measured_causal_rows(runner: ModelRunner) -> int | None:
    """`ModelRunner.sdpa_causal_rows`: `CAUSAL_PROBE` where `sdpa_causal_faster` says so here, else None;
    None untimed off the CPU, where the C++ kernel cannot take the model's cache, and for models whose MLP
    weights are under `FLOAT_PROBE_MIN` elements (tiny test models). Measured once per model load (~0.3 s
    at SmolLM2's heads)."""
    if runner.device.type != "cpu" or not cpu_kernels.selected_usable(runner.dtype, runner.shape.head_dim) \
            or runner._layers[0].mlp.gate_proj.weight.numel() < FLOAT_PROBE_MIN:
        return None
    with torch.no_grad():
        faster = sdpa_causal_faster(runner)
    logger.info("every row of a prompt of %s attends on %s (measured here)",
                f">= {CAUSAL_PROBE} tokens" if faster else "any length", "SDPA's causal kernel" if faster else "the C++ kernel")
    return CAUSAL_PROBE if faster else None


def measured_packed_rows(modules: list[torch.nn.Module], packed: dict[int, PackedWeight]) -> range:
    """The row counts that run on the block codes here: below `packed_rows_limit` of the layers' largest
    packed projection (an MLP's, most of a step's arithmetic), at most `packed.ROWS`; all of
    `packed.ROWS` where the kernels cannot run. Measured once per model load (~0.1 s)."""
    coded = [m for m in modules if id(m) in packed and type(m) is torch.nn.Linear]
    if not coded or not cpu_kernels.ensure():
        return PACKED_ROWS
    layer = max(coded, key=lambda m: m.weight.numel())
    with torch.no_grad():
        limit = min(packed_rows_limit(layer, packed[id(layer)]), PACKED_ROWS.stop)
    logger.info("projections of 1-%d rows run on their block codes, more on MKL (measured here)", limit - 1)
    return range(1, limit)


def _linear_weights(projections: list[torch.nn.Module], linear_dtype: torch.dtype | None,
                    pack: bool) -> tuple[dict[int, torch.Tensor], dict[int, PackedWeight]]:
    """What `ModelRunner.linear` runs the projections on, each keyed by id(module): every nn.Linear's weight
    copied in `linear_dtype` (none for None), and when `pack` the block codes of `packed.pack_linears`."""
    weights = {} if linear_dtype is None else {
        id(m): m.weight.detach().to(linear_dtype) for m in projections if type(m) is torch.nn.Linear}
    return weights, (pack_linears(projections) if pack else {})


def _sdpa_backends(names: tuple | None) -> list | None:
    """SDPBackend members for `names` (None: no restriction)."""
    return None if names is None else [getattr(SDPBackend, n) for n in names]


def _sdpa_kernels(backends: list | None):
    """A context that restricts SDPA to `backends` (torch's own order among them), or a no-op for None.
    Not `set_priority`: its exit left the priority order changed for later calls (torch 2.11)."""
    return contextlib.nullcontext() if backends is None else sdpa_kernel(backends)


def mlp_part_rows(mlp: torch.nn.Module, dtype: torch.dtype, linear_dtype: torch.dtype | None) -> int:
    """The most rows whose MLP intermediate [rows, I] stays within `MLP_PART_BYTES` (at least 64)."""
    size = max(dtype.itemsize, linear_dtype.itemsize if linear_dtype is not None else 0)
    return max(64, MLP_PART_BYTES // (mlp.gate_proj.out_features * size))


def padded_rows(n: int) -> int:
    """The rows `rows_linear` multiplies for n of `SMALL_ROWS`: 2 for one (a matrix-vector product would
    run on one core), n up to 8, else the next multiple of 8 (MKL's fast path)."""
    return 2 if n == 1 else n if n <= 8 else -(-n // 8) * 8


def _needs_grad(*tensors: torch.Tensor) -> bool:
    """Autograd will differentiate through this op (research runs: `benchmarks.quality.oracle`'s gradients)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def rows_linear(layer: torch.nn.Module, x: torch.Tensor, code: PackedWeight | None = None,
                packed_rows: range = PACKED_ROWS, float_rows: range | None = None) -> torch.Tensor:
    """layer(x) for x [T, in]: [T, out]. An fp32 nn.Linear on the CPU with a few rows runs on
    `cpu_kernels.packed_linear` over the weight's block `code` when it has one (`packed_rows`; more rows
    on MKL, what `packed_rows_limit` measured against), else on
    `cpu_kernels.rows_linear` (`float_rows`, more rows on MKL, what `float_rows_limit` measured against;
    None: `cpu_kernels.ROWS`; both where the kernels are built), else `mkl_rows`."""
    n = x.shape[0] if x.dim() == 2 else 0
    if type(layer) is not torch.nn.Linear or x.device.type != "cpu" or x.dtype != torch.float32 \
            or layer.weight.dtype != torch.float32:
        return layer(x)
    packed = code is not None and n in packed_rows
    if code is not None and not packed:
        return layer(x)  # [T, out]: MKL, faster here than the codes at this many rows
    if code is None and float_rows is not None and n >= float_rows.stop:
        return layer(x)  # [T, out]: MKL, faster here than the float32 kernel at this many rows
    kernel_rows = cpu_kernels.ROWS if float_rows is None else float_rows
    if (packed or n in kernel_rows) and not _needs_grad(x, layer.weight) and cpu_kernels.ensure():
        if packed:  # (neither kernel has a backward)
            return cpu_kernels.packed_linear(x, code.codes, code.d, code.m, layer.bias)  # [T, out]
        return cpu_kernels.rows_linear(x, layer.weight, layer.bias)  # [T, out]
    return mkl_rows(layer, x)


def mkl_rows(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """layer(x) for x [T, in] on torch's sgemm: for `SMALL_ROWS` as (W @ x^T)^T, the same product
    through an sgemm that does not repack the weight, on `padded_rows(T)` rows (zeros after x's)."""
    n = x.shape[0] if x.dim() == 2 else 0
    if n not in SMALL_ROWS:
        return layer(x)
    m = padded_rows(n)
    rows = x if m == n else torch.nn.functional.pad(x, (0, 0, 0, m - n))  # [T', in]: zero rows after the T
    out = (layer.weight @ rows.t()).t()[:n]  # [T, out], a transposed view
    if layer.bias is not None:
        out = out + layer.bias  # [T, out]
    return out.contiguous()  # [T, out]
