"""Design probe (issue #37 item 6): vLLM as the decode engine of a blended prompt. Not product code.

Blendserve computes a reordered RAG prompt's blended KV in-process; the KV is handed to vLLM's CPU
server through its KV connector interface (the reference `ExampleConnector`, which loads a
prompt's per-layer KV from safetensors files named by a hash of the prompt's token ids), and vLLM
decodes greedily from it. Questions: does the CPU build accept a connector, do vLLM's greedy tokens
match Blendserve's own decode of the same KV, what does the hand-over cost per prompt token.

The file layout is not assumed: a calibration prompt is first sent to vLLM, which stores its own
KV; that KV is matched against Blendserve's full-prefill KV of the same prompt to find the layout
(and to check that both hold the same numbers). Then the blended KV is written in that layout.

    .venv/bin/python -m benchmarks.vllm_decode_probe [--tokens 24] [--paragraphs 6]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import re
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import torch
from safetensors.torch import load_file, save_file

from benchmarks.data import load_examples, shuffled
from benchmarks.peer_vllm_client import prompt_ids, vllm_body
from benchmarks.peer_vllm_servers import VllmSettings, server, vllm_command, vllm_env, vllm_python
from benchmarks.throughput import free_port
from benchmarks.vllm_model import ensure_model_folder
from blend_engine.engine import BlendEngine, EngineConfig
from blend_engine.kv_store import MemoryStore
from blend_engine.model import ModelRunner
from blend_engine.types import BlendPlan, GenerationConfig, Mode
from retrieval.text import format_passage

logger = logging.getLogger(__name__)
BLOCK = 32  # vLLM's KV block size, set explicitly (the CPU attention backend takes multiples of 32)
OUT = Path(__file__).resolve().parent / "results" / "peer_vllm" / "decode_probe.json"


def folder_hash(ids: list[int]) -> str:
    """ExampleConnector's folder name: md5 of the int64 token ids."""
    return hashlib.md5(np.asarray(ids, dtype=np.int64).tobytes(), usedforsecurity=False).hexdigest()


@torch.inference_mode()
def blend_side(runner: ModelRunner, passages: tuple[str, ...], question: str, n: int) -> dict:
    """Blendserve: store the passages, blend the reordered prompt, decode `n` greedy tokens from it."""
    engine = BlendEngine(runner, MemoryStore(1 << 30, kv_format="fp32"), EngineConfig(kv_format="fp32"))
    for _ in engine.generate(BlendPlan(passages, question, numbered=True), GenerationConfig(max_tokens=1)):
        pass  # the answer's end stores the missed passages' alone-KV
    out = {}
    for mode in (Mode.BLEND, Mode.FULL_PREFILL):
        plan = BlendPlan(shuffled(passages, "probe"), question, mode=mode, numbered=True)
        t0 = time.perf_counter()
        state = engine.prefill(plan, max_new_tokens=n + 1)
        prefill_s = time.perf_counter() - t0
        T = state.cache.length
        k = torch.stack([kl[:, :T] for kl in state.cache.k]).clone()  # [L, H, T, D]
        v = torch.stack([vl[:, :T] for vl in state.cache.v]).clone()  # [L, H, T, D]
        tokens, tok = [], int(torch.argmax(state.logits))
        for _ in range(n):
            tokens.append(tok)
            tok = int(torch.argmax(engine.decode_step(state.cache, tok)))
        out[mode.value] = {"ids": state.layout.token_ids(), "k": k, "v": v, "tokens": tokens, "prefill_s": prefill_s}
    return out


def cpu_blocks(k: torch.Tensor, v: torch.Tensor, T: int) -> torch.Tensor:
    """One layer's K and V [H, >=T, D] as ExampleConnector's file holds them for vLLM's CPU backend.

    The CPU backend's cache is [blocks, H, BLOCK, 2D] (LBHNC), read as [blocks, H, 2 * BLOCK, D]: per
    block and head, K *transposed* ([D, BLOCK], element (t, d) at d * BLOCK + t; what
    `cpu_attn_reshape_and_cache` writes for the `vec` ISA, checked by calling it), then V as [BLOCK, D].
    The connector copies `cache[block, :, offset]` (2D numbers) per token slot, so file row t is the
    (t % BLOCK)-th run of 2D numbers of its block's head buffer, not token t's K and V.
    """
    H, _, D = k.shape
    n = T // BLOCK
    kb = k[:, :T].reshape(H, n, BLOCK, D).permute(1, 0, 3, 2)  # [n, H, D, BLOCK]: K transposed per block
    vb = v[:, :T].reshape(H, n, BLOCK, D).permute(1, 0, 2, 3)  # [n, H, BLOCK, D]
    heads = torch.cat([kb.reshape(n, H, D * BLOCK), vb.reshape(n, H, BLOCK * D)], -1)  # [n, H, 2 * BLOCK * D]
    return heads.reshape(n, H, BLOCK, 2 * D).permute(0, 2, 1, 3).reshape(T, H, 2 * D).contiguous()  # [T, H, 2D]


LAYOUTS = {  # name -> one layer's K, V [H, T, D] arranged as the connector's tensor
    "CPU blocks (K^T | V per block and head)": cpu_blocks,
    "[T, H, 2D]": lambda k, v, T: torch.cat([k[:, :T], v[:, :T]], -1).permute(1, 0, 2).contiguous(),
    "[T, 2, H, D]": lambda k, v, T: torch.stack([k[:, :T], v[:, :T]]).permute(2, 0, 1, 3).contiguous(),
    "[2, T, H, D]": lambda k, v, T: torch.stack([k[:, :T], v[:, :T]]).permute(0, 2, 1, 3).contiguous(),
}


def layout_diffs(saved: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, float]:
    """The largest difference between the connector's tensor [T, ...] and each candidate layout of
    one layer's K and V [H, T', D] (T' >= T) whose shape fits; the right one is near fp32 noise."""
    T = saved.shape[0]
    out = {}
    for name, arrange in LAYOUTS.items():
        c = arrange(k, v, T)
        if c.shape == saved.shape:
            out[name] = float((c - saved.float()).abs().max())
    if not out:
        raise RuntimeError(f"the connector's tensor {tuple(saved.shape)} matches no known layout")
    return out


async def ask(url: str, ids: list[int], n: int) -> tuple[list[int], float]:
    body = vllm_body(ids, n, True) | {"stream": False, "ignore_eos": True}  # n tokens, as Blendserve's decode
    body.pop("stream_options")
    async with httpx.AsyncClient(timeout=3600) as http:
        t0 = time.perf_counter()
        r = await http.post(f"{url}/v1/completions", json=body)
        r.raise_for_status()
        seconds = time.perf_counter() - t0
    tokens = [int(t.removeprefix("token_id:")) for t in r.json()["choices"][0]["logprobs"]["tokens"]]
    return tokens, seconds


def run(args: argparse.Namespace) -> dict:
    model_dir = ensure_model_folder()
    runner = ModelRunner.load("default", device="cpu", dtype="float32")
    ex = load_examples("musique", 1, offset=150)[0]
    passages = tuple(format_passage(p.text, p.title) for p in ex.paragraphs[: args.paragraphs])
    ours = blend_side(runner, passages, ex.question, args.tokens)
    calib = prompt_ids(runner.tokenizer, passages[:2], "What is this about?")
    storage = Path(tempfile.mkdtemp(prefix="vllm-kv-probe-"))
    cfg = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
    s = VllmSettings(prefix_caching=False)
    cmd = vllm_command(vllm_python(), model_dir, s, port := free_port()) + [
        "--kv-transfer-config", json.dumps(cfg), "--block-size", str(BLOCK)]
    result: dict = {"prompt_tokens": len(ours["blend"]["ids"]), "storage": str(storage)}
    with server(cmd, vllm_env(dict(os.environ), s), OUT.parent / "logs" / "vllm-probe.log",
                "the vLLM server (KV connector)", "/health", port, args.start_timeout) as url:
        asyncio.run(ask(url, calib, 1))  # vLLM stores the calibration prompt's KV
        folders = [p for p in storage.iterdir() if p.is_dir()]
        result["calibration_folders"] = len(folders)
        layer_files = sorted(folders[0].glob("*.safetensors"), key=_layer_index)
        full_cal = _full_kv(runner, calib)
        diffs = [layout_diffs(load_file(f)["kv_cache"], *full_cal[i]) for i, f in enumerate(layer_files)]
        worst = {name: max(d[name] for d in diffs) for name in diffs[0]}  # per layout, over layers
        result["layout"] = min(worst, key=worst.get)
        result["calibration_max_abs_diff"] = worst
        result |= _hand_over(url, storage, layer_files, ours, result["layout"], args.tokens)
    return result


def _layer_index(path: Path) -> int:
    """`model.layers.12.self_attn.attn.safetensors` -> 12."""
    return int(re.search(r"layers\.(\d+)\.", path.name).group(1))


def _full_kv(runner: ModelRunner, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Blendserve's full prefill of `ids` alone: per layer (K [H, T, D], V [H, T, D])."""
    engine = BlendEngine(runner, MemoryStore(1 << 28, kv_format="fp32"), EngineConfig(kv_format="fp32"))
    with torch.inference_mode():
        kv = engine.chunks.precompute(ids)  # k, v: [L, H, T, D]
    return [(kv.k[i], kv.v[i]) for i in range(kv.k.shape[0])]


def _hand_over(url: str, storage: Path, layer_files: list[Path], ours: dict, layout: str, n: int) -> dict:
    """vLLM's own cold prefill of the prompt first (its connector stores that KV, checked against
    Blendserve's full prefill), then Blendserve's full-prefill KV (the control), then its blended KV:
    each written where the connector looks for it, then the prompt asked greedily (vLLM recomputes
    the tail after the last whole block)."""
    ids = ours["blend"]["ids"]
    aligned = (len(ids) - 1) // BLOCK * BLOCK  # what ExampleConnector loads: whole blocks, never the last token
    if (len(ids) - 1) % BLOCK == 0:  # its lookup then hashes one block less than its load: not handled here
        raise RuntimeError(f"a {len(ids)}-token prompt hits ExampleConnector's off-by-one block; change --paragraphs")
    folder = storage / folder_hash(ids[:aligned])
    tokens, seconds = asyncio.run(ask(url, ids, n))  # nothing to load: vLLM prefills and stores its KV
    saved = [load_file(folder / f.name)["kv_cache"] for f in layer_files]
    full = ours["full_prefill"]
    own_diff = max(float((LAYOUTS[layout](full["k"][i], full["v"][i], aligned) - t).abs().max())
                   for i, t in enumerate(saved))
    out: dict = {"vllm_cold": {"request_s": seconds, "greedy_tokens_equal_full_prefill": _agreement(tokens, full["tokens"]),
                               "stored_kv_max_abs_diff_vs_blendserve_full_prefill": own_diff, "tokens": tokens}}
    for mode in ("full_prefill", "blend"):
        t0 = time.perf_counter()
        for i, f in enumerate(layer_files):
            save_file({"kv_cache": LAYOUTS[layout](ours[mode]["k"][i], ours[mode]["v"][i], aligned)}, folder / f.name)
        write_s = time.perf_counter() - t0
        tokens, seconds = asyncio.run(ask(url, ids, n))
        out[mode] = {"handed_over_tokens": aligned, "write_s": write_s, "write_us_per_token": write_s / aligned * 1e6,
                     "vllm_request_s": seconds, "greedy_tokens_equal": _agreement(tokens, ours[mode]["tokens"]),
                     "vllm_tokens": tokens, "blendserve_tokens": ours[mode]["tokens"],
                     "blendserve_prefill_s": ours[mode]["prefill_s"]}
    return out


def _agreement(a: list[int], b: list[int]) -> str:
    """"equal/n, first difference at i" for two greedy token lists."""
    same = sum(x == y for x, y in zip(a, b))
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return f"{same}/{len(b)}" + ("" if first is None else f", first difference at token {first}")


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.vllm_decode_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--paragraphs", type=int, default=6)
    p.add_argument("--start-timeout", type=float, default=900)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    result = run(args)
    OUT.write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
