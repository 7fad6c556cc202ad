"""The llama.cpp peer benchmark: runs only where a binding is installed (make bench-peer-install)."""

from __future__ import annotations

import pytest

from benchmarks.common.data import Context
from benchmarks.peers import peer

needs_binding = pytest.mark.skipif(peer.backend_name() is None, reason="no llama.cpp binding installed")
needs_cffi = pytest.mark.skipif(peer.backend_name() != "llama-cpp-cffi", reason="llama-cpp-cffi not installed")

PASSAGES = (
    "Paris\nParis is the capital and largest city of France.",
    "Berlin\nBerlin is the capital of Germany and its most populous city.",
    "Rome\nRome is the capital city of Italy, founded, legend says, in 753 BC.",
)


def test_common_prefix():
    assert peer.common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert peer.common_prefix([], [1]) == 0
    assert peer.common_prefix([1, 2], [1, 2]) == 2


@pytest.mark.slow
@needs_binding
def test_run_peer_gives_three_cases_with_prefix_reuse(real_runner):
    ctx = Context("What is the capital of Italy?", PASSAGES, 60)
    rows = peer.run_peer([(60, ctx)], real_runner, threads=1)
    assert [r.case for r in rows] == list(peer.CASES)
    assert all(r.ttft_ms > 0 and r.target_tokens == 60 for r in rows)
    n = rows[0].context_tokens
    cold, cached, reordered = rows
    assert cold.reused_tokens == 0 and cached.reused_tokens == n - 1
    assert 0 < reordered.reused_tokens < n - 1  # the system prefix only
    assert cached.first_token == cold.first_token


@pytest.mark.slow
@needs_cffi
def test_llama_cpp_vocab_matches_our_tokenizer(real_runner):
    text = "<|im_start|>user\nWho wrote Hamlet?  Émile Zola, 1840–1902; 日本語.<|im_end|>\n"
    with peer.CffiLlama(peer.default_gguf_path(), n_ctx=256, n_threads=1) as llm:
        assert llm.n_vocab == real_runner.shape.vocab
        assert llm.tokenize(text) == real_runner.encode(text)
