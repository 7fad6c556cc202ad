"""Loading from a .gguf file, for each family transformers ships a GGUF mapping for (llama, qwen2,
qwen3): a tiny random model is written with the `gguf` package (llama.cpp's tensor names, its q/k
row permutation for llama, a small byte-level BPE tokenizer with a chat template), loaded through
`ModelRunner.load` (transformers' GGUF reader, de-quantized and cached) and must give the original
model's logits; blend at ratio 1 on the loaded model equals its full prefill.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode

from blend_engine.engine import BlendEngine, EngineConfig
from blend_engine.kv_store import MemoryStore
from blend_engine.model.runner import ModelRunner
from blend_engine.types import BlendPlan
from tests.helpers import PASSAGES, QUESTION, perturb

gguf = pytest.importorskip("gguf")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e"]
TOKENS = SPECIALS + list(bytes_to_unicode().values()) + ["Ġt", "he"]
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                 "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")
# qwen3: transformers' GGUF mapping has no attention.key_length, so head_dim stays its default, 128
_COMMON = dict(vocab_size=len(TOKENS), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
ARCHS = {
    "llama": (gguf.MODEL_ARCH.LLAMA, lambda: LlamaForCausalLM(LlamaConfig(**_COMMON))),
    "qwen2": (gguf.MODEL_ARCH.QWEN2, lambda: Qwen2ForCausalLM(Qwen2Config(**_COMMON))),
    "qwen3": (gguf.MODEL_ARCH.QWEN3, lambda: Qwen3ForCausalLM(Qwen3Config(**_COMMON, head_dim=128))),
}


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order for llama (transformers' GGUF reader undoes it)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, dim, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, arch_name: str, path) -> None:
    cfg = model.config
    arch = ARCHS[arch_name][0]
    w = gguf.GGUFWriter(str(path), arch_name)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(TOKENS)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    for name, t in model.state_dict().items():
        g = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert g is not None, name
        a = t.detach().float().numpy()
        if arch_name == "llama" and g.endswith("attn_q.weight"):
            a = _llama_cpp_permute(a, cfg.num_attention_heads)
        elif arch_name == "llama" and g.endswith("attn_k.weight"):
            a = _llama_cpp_permute(a, cfg.num_key_value_heads)
        w.add_tensor(g, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_gguf_file_loads_exactly_and_blends(arch, tmp_path):
    torch.manual_seed(0)
    original = perturb(ARCHS[arch][1]())
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(original, arch, path)

    runner = ModelRunner.load(str(path), device="cpu", dtype="float32", cache_dir=tmp_path / "cache")
    assert runner.model.config.model_type == arch
    engine = BlendEngine(runner, MemoryStore(1 << 30, kv_format="fp32"), EngineConfig(kv_format="fp32"))
    full = engine.prefill(BlendPlan(PASSAGES, QUESTION, mode="full_prefill"))
    ids = full.layout.token_ids()
    assert runner.decode(runner.encode(QUESTION)) == QUESTION and runner.tokenizer.chat_template == CHAT_TEMPLATE
    with torch.no_grad():
        ref = original(torch.tensor([ids])).logits[0, -1]  # the weights as written, before the GGUF round trip
    assert (full.logits - ref).abs().max().item() < 1e-4
    for p in PASSAGES:
        engine.ensure_cached(p)
    blend = engine.prefill(BlendPlan(PASSAGES, QUESTION, mode="blend", recompute_ratio=1.0))
    assert blend.report.cache_hits >= len(PASSAGES)
    assert (blend.logits - full.logits).abs().max().item() < 1e-4
    assert any((tmp_path / "cache").iterdir())  # de-quantized once, cached for the next start


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_one_pass_reader_matches_transformers_generic_loader(arch, tmp_path):
    """gguf_convert (one fast metadata pass) gives the config and tokenizer transformers' generic
    GGUF loader gives, and the prepared folder is written once, in the run dtype."""
    from transformers import AutoConfig, AutoTokenizer

    from blend_engine.model import gguf_convert
    from blend_engine.model.files import _gguf_cache_dir

    torch.manual_seed(0)
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(perturb(ARCHS[arch][1]()), arch, path)
    ours = gguf_convert.read_config(path).to_dict()
    ref = AutoConfig.from_pretrained(tmp_path, gguf_file=path.name).to_dict()
    for key in ("_name_or_path", "transformers_version"):
        ours.pop(key, None), ref.pop(key, None)
    assert ours == ref
    tok, ref_tok = gguf_convert.read_tokenizer(path), AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    assert tok.encode(QUESTION) == ref_tok.encode(QUESTION) and tok.chat_template == ref_tok.chat_template

    runner = ModelRunner.load(str(path), device="cpu", dtype="bfloat16", cache_dir=tmp_path / "cache")
    cached = _gguf_cache_dir(path, tmp_path / "cache", torch.bfloat16)
    assert cached.name.endswith("-bfloat16") and (cached / "config.json").exists()
    assert runner.model.dtype == torch.bfloat16
    again = ModelRunner.load(str(path), device="cpu", dtype="bfloat16", cache_dir=tmp_path / "cache")
    assert all(torch.equal(a, b) for a, b in zip(runner.model.state_dict().values(),
                                                 again.model.state_dict().values()))


def test_unwritable_model_cache_prepares_in_memory(tmp_path):
    """A cache folder that cannot be created (here: a file in the way) costs the cache, not the start."""
    torch.manual_seed(0)
    original = perturb(ARCHS["llama"][1]())
    path = tmp_path / "tiny-llama.gguf"
    write_gguf(original, "llama", path)
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    runner = ModelRunner.load(str(path), device="cpu", dtype="float32", cache_dir=blocker / "cache")
    ids = torch.tensor([runner.encode(QUESTION)])
    with torch.no_grad():
        assert torch.allclose(runner.model(ids).logits, original(ids).logits, atol=1e-4)
