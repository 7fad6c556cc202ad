"""The Triton kernel of pooled decode attention (`executor.paged_decode`) against dense SDPA.

Runs where Triton runs: on CUDA, or on the CPU under its interpreter (Triton is a dev dependency;
tests/conftest.py sets TRITON_INTERPRET=1 without CUDA). On a GPU, test_models.py also checks the
kernel in every model family's decode step.
"""

from __future__ import annotations

import pytest
import torch

from blend_engine.executor import paged_decode as pd
from tests.helpers import dense_decode_reference


def _runs_here() -> bool:
    return pd.available(torch.device("cpu")) or (torch.cuda.is_available() and pd.triton is not None)


pytestmark = pytest.mark.skipif(not _runs_here(), reason="needs Triton (CUDA, or TRITON_INTERPRET=1 on the CPU)")


@pytest.mark.parametrize("n_splits", [1, 3, None])
@pytest.mark.parametrize("window", [None, 24])
def test_the_kernel_equals_dense_attention_over_each_rows_slots(n_splits, window):
    """Ragged rows (one shorter than a block, so later key ranges are empty; one spanning several
    blocks per range), key ranges 1 / 3 / the rule's, with and without a sliding window."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(3)
    h, grp, d = 2, 3, 16
    lengths, starts = [5, 130, 77], [0, 200, 400]
    k = torch.randn(h, 512, d, generator=g)  # [H, slots, D]
    v = torch.randn(h, 512, d, generator=g)
    q = torch.randn(len(lengths), h, grp, d, generator=g)  # [B, H, G, D]
    start, n = torch.tensor(starts), torch.tensor(lengths)
    pos = n - 1
    want = dense_decode_reference(q, k, v, start, n, pos, window, d ** -0.5)
    got = pd.paged_decode(*(t.to(device) for t in (q, k, v, start, n, pos)), window, d ** -0.5, block=32,
                          n_splits=n_splits)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


def test_splits_fill_the_device_only_when_rows_are_few():
    assert pd.splits(1, 8) == 32 and pd.splits(4, 8) == 8 and pd.splits(8, 8) == 1 and pd.splits(64, 8) == 1


def test_a_decode_step_through_the_kernel_equals_the_per_sequence_oracle():
    """The kernel inside `decode_batch` on a sliding-window model (Mistral, window 24): logits and the
    K/V written equal the per-sequence step's (ragged rows past the window; the rule's key ranges, all
    but the first empty at these lengths)."""
    from transformers import MistralConfig, MistralForCausalLM

    from blend_engine.executor.decode import decode_batch
    from blend_engine.model.runner import ModelRunner
    from tests.helpers import TINY_CONFIG, pool_kv, ragged_pool, real_tokenizer

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(**TINY_CONFIG, sliding_window=24))
    runner = ModelRunner(model, real_tokenizer(), "tiny mistral")
    pool, runs, lengths = ragged_pool(runner)
    start = pool_kv(pool, pool.scratch_slot)
    results = {}
    for way in ("per_sequence", "triton"):
        for (k, v), (k0, v0) in zip(zip(*pool.kv), start):
            k[:, :pool.scratch_slot], v[:, :pool.scratch_slot] = k0, v0
        caches = [pool.view(run, n) for run, n in zip(runs, lengths)]
        attention, kernel = ("per_sequence", None) if way == "per_sequence" else ("pooled", "triton")
        logits = decode_batch(runner, caches, [11, 22, 33], lengths, attention, kernel=kernel)  # [B, V]
        results[way] = logits, pool_kv(pool, pool.scratch_slot)
    torch.testing.assert_close(results["triton"][0], results["per_sequence"][0], rtol=1e-4, atol=1e-4)
    for (k, v), (k2, v2) in zip(results["triton"][1], results["per_sequence"][1]):
        torch.testing.assert_close(k, k2, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v, v2, rtol=1e-4, atol=1e-5)
