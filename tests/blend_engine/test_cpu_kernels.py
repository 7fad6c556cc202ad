"""Blendserve's CPU kernels (`blend_engine.model.cpu_kernels`): pooled decode attention against dense SDPA,
the few-rows projection against nn.Linear, and the rules that pick them. The kernels are built here
(a C++ compiler is part of the CI image): a build failure fails these tests rather than skipping
them. test_models.py also runs the decode kernel inside every model family's decode step."""

from __future__ import annotations

import logging

import pytest
import torch

from blend_engine.executor.decode import decode_attention, pooled_kernel
from blend_engine.model import cpu_kernels, packed
from blend_engine.model.runner import rows_linear
from tests.helpers import dense_decode_reference, ragged_pool, tiny_runner


@pytest.fixture(scope="module")
def kernel():
    assert cpu_kernels.ensure(), cpu_kernels.why_not()


def _case(lengths: list[int], h: int, grp: int, d: int, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    starts = [sum(lengths[:i]) + 7 * i for i in range(len(lengths))]  # runs apart, not at slot 0
    slots = starts[-1] + lengths[-1] + 5
    k = torch.randn(h, slots, d, generator=g)  # [H, slots, D]
    v = torch.randn(h, slots, d, generator=g)
    q = torch.randn(len(lengths), h, grp, d, generator=g)  # [B, H, G, D]
    n = torch.tensor(lengths)
    return q, k, v, torch.tensor(starts), n, n - 1


@pytest.mark.parametrize("window", [None, 1, 24])
@pytest.mark.parametrize(("h", "grp", "d"), [(2, 3, 16), (3, 3, 64), (1, 1, 24), (4, 2, 80)])
def test_the_kernel_equals_dense_attention_over_each_rows_slots(kernel, window, h, grp, d):
    """Ragged rows (one key, shorter than the window, past it), grouped and plain heads, head dims
    that are and are not a multiple of the vector width."""
    q, k, v, start, n, pos = _case([1, 5, 130, 77], h, grp, d)
    want = dense_decode_reference(q, k, v, start, n, pos, window, d ** -0.5)
    got = cpu_kernels.paged_decode(q, k, v, start, n, pos, window, d ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 700])
@pytest.mark.parametrize(("grp", "d"), [(3, 64), (4, 80), (1, 256), (2, 24)])
def test_rows_longer_than_a_work_item_merge_their_parts(kernel, window, grp, d):
    """Rows of 513-1,300 keys are cut into parts of 512 and merged; a window that starts inside a part."""
    q, k, v, start, n, pos = _case([1300, 513, 512, 40], 2, grp, d)
    want = dense_decode_reference(q, k, v, start, n, pos, window, d ** -0.5)
    got = cpu_kernels.paged_decode(q, k, v, start, n, pos, window, d ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_rows_output_does_not_depend_on_the_rows_beside_it(kernel):
    """Bit for bit: how a row's keys are split into work items depends on its own length alone, so
    batched decoding gives the tokens decoding alone gives."""
    q, k, v, start, n, pos = _case([1300, 77, 600, 5], 3, 3, 64)
    batched = cpu_kernels.paged_decode(q, k, v, start, n, pos, None, 0.125)
    for b in range(q.shape[0]):
        alone = cpu_kernels.paged_decode(q[b:b + 1], k, v, start[b:b + 1], n[b:b + 1], pos[b:b + 1], None, 0.125)
        assert torch.equal(alone[0], batched[b])


def _selected_case(h: int, grp: int, d: int, n: int, rows: int, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(h, n + 9, d, generator=g)[:, :n]  # a view of a larger cache, as a blend's K is
    v = torch.randn(h, n + 9, d, generator=g)[:, :n]
    q = torch.randn(h * grp, rows, d, generator=g)  # [Hq, S, D]
    pos = torch.randperm(n, generator=g)[:rows].sort().values  # [S]
    return q, k, v, pos


def _selected_reference(q, k, v, pos, window, scale):
    """Dense SDPA of the rows at `pos` over every key with a boolean mask by absolute position: [S, Hq*D]."""
    j = torch.arange(k.shape[1])[None, :]
    allowed = (j <= pos[:, None]) if window is None else (j <= pos[:, None]) & (j > pos[:, None] - window)  # [S, N]
    out = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=allowed[None, None],
                                                           scale=scale, enable_gqa=True)  # [1, Hq, S, D]
    return out[0].transpose(0, 1).reshape(q.shape[1], -1)


@pytest.mark.parametrize("window", [None, 1, 100])
@pytest.mark.parametrize(("h", "grp", "d", "n", "rows"), [
    (3, 3, 64, 700, 50),  # SmolLM2's heads, a blend's scattered rows
    (2, 2, 16, 300, 300),  # every position: a causal prefill
    (2, 4, 128, 517, 70),  # Llama's head dim, a tile of 3 vectors
    (1, 6, 80, 333, 1),  # one row; a head dim whose tiles hold 4 vectors
    (4, 1, 32, 129, 21),  # no grouping
])
def test_selected_attention_equals_dense_attention_by_position(kernel, window, h, grp, d, n, rows):
    q, k, v, pos = _selected_case(h, grp, d, n, rows)
    got = cpu_kernels.selected_attention(q, k, v, pos, window, d ** -0.5)
    torch.testing.assert_close(got, _selected_reference(q, k, v, pos, window, d ** -0.5), rtol=1e-5, atol=1e-5)


def test_a_selected_rows_output_does_not_depend_on_the_rows_beside_it(kernel):
    """Bit for bit: key blocks are aligned by absolute position, so a row computed alone, in another
    work item or beside other rows gives the same output (a prefill's chunks, batched or not)."""
    q, k, v, pos = _selected_case(3, 3, 64, 600, 90)
    together = cpu_kernels.selected_attention(q, k, v, pos, None, 0.125)
    for s in (0, 17, 89):
        alone = cpu_kernels.selected_attention(q[:, s:s + 1], k, v, pos[s:s + 1], None, 0.125)
        assert torch.equal(alone[0], together[s])


def test_selected_attention_refuses_what_it_cannot_take(kernel):
    q, k, v, pos = _selected_case(2, 2, 64, 100, 10)
    with pytest.raises(RuntimeError, match="sorted"):
        cpu_kernels.selected_attention(q, k, v, pos.flip(0), None, 0.125)
    with pytest.raises(RuntimeError, match="within the keys"):
        cpu_kernels.selected_attention(q, k, v, pos + 100, None, 0.125)
    with pytest.raises(RuntimeError, match="head dim"):
        cpu_kernels.selected_attention(q[..., :24], k[..., :24], v[..., :24], pos, None, 0.125)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels.selected_attention(q.double(), k.double(), v.double(), pos, None, 0.125)
    assert cpu_kernels.selected_usable(torch.float32, 64) and not cpu_kernels.selected_usable(torch.float32, 24)
    assert not cpu_kernels.selected_usable(torch.bfloat16, 64)


def test_one_row_and_a_non_contiguous_query(kernel):
    q, k, v, start, n, pos = _case([300], 3, 3, 64)
    qt = q.transpose(2, 3).contiguous().transpose(2, 3)  # [B, H, G, D] with another memory order
    want = dense_decode_reference(q, k, v, start, n, pos, None, 0.125)
    torch.testing.assert_close(cpu_kernels.paged_decode(qt, k, v, start, n, pos, None, 0.125), want, rtol=1e-5, atol=1e-5)


def test_inputs_it_cannot_take_are_refused(kernel):
    q, k, v, start, n, pos = _case([5, 9], 2, 3, 16)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels.paged_decode(q.double(), k.double(), v.double(), start, n, pos, None, 0.25)
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu_kernels.paged_decode(q, k, v, start + k.shape[1], n, pos, None, 0.25)
    with pytest.raises(RuntimeError, match="one value per row"):
        cpu_kernels.paged_decode(q, k, v, start[:1], n, pos, None, 0.25)


def test_auto_reads_a_float32_pool_in_place_on_the_cpu(kernel):
    runner = tiny_runner()
    pool, runs, lengths = ragged_pool(runner)
    caches = [pool.view(run, m) for run, m in zip(runs, lengths)]
    cpu = torch.device("cpu")
    assert pooled_kernel(cpu) == "cpu" and pooled_kernel(cpu, torch.bfloat16) == "gather"
    assert decode_attention("auto", cpu, caches) == "pooled"
    assert decode_attention("per_sequence", cpu, caches) == "per_sequence"


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("n_in", "n_out"), [(48, 7), (50, 192), (576, 1536)])
def test_rows_linear_equals_nn_linear(kernel, bias, n_in, n_out):
    """Row counts across the 8 / 4 / 2 / 1-row tiles, in_features with and without a tail past the
    16-wide vectors, out_features not a multiple of the 3-row weight blocks."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(n_in, n_out, bias=bias)
    for rows in (1, 3, 5, 8, 9, 15, 17, 64, 128):
        x = torch.randn(rows, n_in)
        torch.testing.assert_close(cpu_kernels.rows_linear(x, layer.weight, layer.bias), layer(x), rtol=1e-5, atol=1e-5)
    x = torch.randn(2 * n_in, 9)[::2].t()  # [9, in], a transposed, strided view
    torch.testing.assert_close(cpu_kernels.rows_linear(x, layer.weight, layer.bias), layer(x), rtol=1e-5, atol=1e-5)


def test_the_model_projects_few_rows_through_it(kernel, monkeypatch):
    calls = []
    real = cpu_kernels.rows_linear
    monkeypatch.setattr(cpu_kernels, "rows_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    layer = torch.nn.Linear(64, 32)
    with torch.inference_mode():
        for rows in (1, 2, 3, 128, 129):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(rows_linear(layer, x), layer(x), rtol=1e-5, atol=1e-5)
        assert calls == [3, 128]  # 1-2 rows: MKL's W @ [x; x]^T; past 128: MKL's sgemm
        rows_linear(layer.double(), torch.randn(5, 64, dtype=torch.float64))  # not float32: nn.Linear
        assert calls == [3, 128]
    x = torch.randn(5, 64, requires_grad=True)
    rows_linear(layer.float(), x).sum().backward()  # a gradient to take: nn.Linear (the kernel has no backward)
    assert calls == [3, 128] and x.grad is not None
    with torch.no_grad():
        rows_linear(layer.float(), x)
    assert calls == [3, 128, 5]


def test_rows_linear_refuses_what_it_cannot_take(kernel):
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels.rows_linear(torch.randn(4, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64), None)
    with pytest.raises(RuntimeError, match="in_features"):
        cpu_kernels.rows_linear(torch.randn(4, 8), torch.randn(3, 9), None)
    with pytest.raises(RuntimeError, match="bias"):
        cpu_kernels.rows_linear(torch.randn(4, 8), torch.randn(3, 8), torch.randn(4))


def test_where_they_cannot_be_built_the_engine_says_why_and_keeps_torchs(monkeypatch, caplog):
    from torch.utils import cpp_extension

    def no_compiler(**_kwargs):
        raise RuntimeError("Error building extension: c++: not found")

    monkeypatch.setattr(cpu_kernels, "_state", {})  # not tried yet in this process (restored afterwards)
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    runner = tiny_runner()
    pool, runs, lengths = ragged_pool(runner)
    caches = [pool.view(run, m) for run, m in zip(runs, lengths)]
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert decode_attention("auto", torch.device("cpu"), caches) == "per_sequence"
        assert pooled_kernel(torch.device("cpu")) == "gather"
        layer, x = torch.nn.Linear(16, 8), torch.randn(5, 16)
        torch.testing.assert_close(rows_linear(layer, x), layer(x), rtol=1e-5, atol=1e-5)  # MKL's
    assert "c++: not found" in cpu_kernels.why_not()
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1  # said once
    assert "unavailable" in caplog.records[0].getMessage()


def _coded_weight(n_out: int, n_in: int, kind: str, seed: int = 0) -> torch.Tensor:
    """A float32 weight de-quantized from a block code, as a GGUF's loader makes it: a4 (Q4_1: every
    block holds its q = 0 and q = 15) or s8 (Q8_0: every block holds a |q| = 127), float16 d and m."""
    g = torch.Generator().manual_seed(seed)
    d = torch.rand(n_out, n_in // 32, generator=g).half().float().repeat_interleave(32, 1)  # [out, in]
    if kind == "a4":
        q = torch.randint(0, 16, (n_out, n_in), generator=g).float()
        q[:, ::32], q[:, 1::32] = 0, 15
        m = (torch.randn(n_out, n_in // 32, generator=g) * 0.1).half().float().repeat_interleave(32, 1)
        return d * q + m
    q = torch.randint(-127, 128, (n_out, n_in), generator=g).float()
    q[:, 3::32] = -127
    return d * q


@pytest.mark.parametrize("kind", ["a4", "s8"])
@pytest.mark.parametrize(("n_in", "n_out"), [(64, 7), (576, 192), (1536, 576)])
def test_a_coded_weight_is_packed_and_projects_bit_for_bit_like_its_float32(kernel, kind, n_in, n_out):
    """The code is found from the float32 weight alone, expands to it exactly, and the packed kernel
    equals `rows_linear` on the float32 weight bit for bit at every tile size (1 to 8 rows and past)."""
    w = _coded_weight(n_out, n_in, kind)
    code = packed.pack(w)
    assert code is not None and (code.m is not None) == (kind == "a4")
    assert torch.equal(code.expand(), w)
    assert code.nbytes < w.numel() * 4 / (4.5 if kind == "a4" else 3)
    bias = torch.randn(n_out)
    for rows in (1, 2, 3, 5, 8, 9, 13, 64, 200):  # the codes expanded in registers under 9 rows, in a buffer from 9
        x = torch.randn(rows, n_in)
        assert torch.equal(cpu_kernels.packed_linear(x, code.codes, code.d, code.m, bias),
                           cpu_kernels.rows_linear(x, w, bias))


def test_weights_without_a_block_code_are_left_as_they_are():
    torch.manual_seed(0)
    assert packed.pack(torch.randn(8, 64)) is None  # a float checkpoint's weight
    assert packed.pack(_coded_weight(8, 64, "a4")[:, :48].contiguous()) is None  # in not a multiple of 32
    assert packed.pack(_coded_weight(8, 64, "a4").double()) is None
    w = _coded_weight(8, 64, "a4")
    w[3, 5] = w[3, 5] + 1e-3  # one weight off its block's grid
    assert packed.pack(w) is None
    w[3, 5] = float("nan")
    assert packed.pack(w) is None


def test_packed_linear_refuses_what_it_cannot_take(kernel):
    code = packed.pack(_coded_weight(8, 64, "a4"))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu_kernels.packed_linear(torch.randn(2, 48), code.codes, code.d, code.m, None)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels.packed_linear(torch.randn(2, 64).double(), code.codes, code.d, code.m, None)
    with pytest.raises(RuntimeError, match="s8 codes"):
        cpu_kernels.packed_linear(torch.randn(2, 64), code.codes, code.d, None, None)


def test_the_default_model_decodes_from_its_codes_with_the_same_outputs(kernel, real_runner):
    """SmolLM2's GGUF is Q4_1 (every projection) and Q8_0 (the tied lm_head): all of them are kept in
    their code, and few-row projections (the measured `packed_rows`) read it, equal bit for bit to the
    float32 kernel's."""
    from blend_engine.model.runner import ModelRunner

    n_proj = sum(type(m) is torch.nn.Linear for m in real_runner._layers.modules())
    assert len(real_runner._packed) == n_proj + 1
    assert real_runner._packed[id(real_runner._lm_head)].m is None  # s8
    plain = ModelRunner(real_runner.model, real_runner.tokenizer, packed=False, float_rows=cpu_kernels.ROWS)
    assert plain._packed == {}
    torch.manual_seed(0)
    blk = real_runner._layers[3]
    with torch.inference_mode():
        top = real_runner.packed_rows[-1]  # the most rows on the codes
        for rows in sorted({min(3, top), min(8, top), top}):
            x = torch.randn(rows, real_runner.shape.hidden)
            for mod in (blk.self_attn.q_proj, blk.mlp.up_proj, real_runner._lm_head):
                assert torch.equal(real_runner.linear(mod, x), plain.linear(mod, x))
        # MKL's products on float32, the codes' on packed: another order of the sums
        for rows in (1, top + 1, 200):
            x = torch.randn(rows, real_runner.shape.hidden)
            torch.testing.assert_close(real_runner.linear(blk.mlp.up_proj, x), plain.linear(blk.mlp.up_proj, x),
                                       rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("h", "t", "d", "c"), [(3, 448, 64, 600), (2, 5, 16, 9), (4, 1093, 128, 2000), (1, 3, 6, 4)])
def test_place_rotated_writes_what_torchs_rotation_and_copies_write_bit_for_bit(kernel, h, t, d, c):
    """Keys moved by `ModelRunner.apply_rotation` and values copied into a strided cache view at any
    slots (sorted or not), nothing else touched; one case big enough for the parallel loop."""
    from blend_engine.model.runner import ModelRunner

    g = torch.Generator().manual_seed(t)
    k, v = torch.randn(h, t, d, generator=g) * 5, torch.randn(h, t, d, generator=g)  # [H, Tc, D]
    cos, sin = torch.randn(t, d, generator=g), torch.randn(t, d, generator=g)  # [Tc, D]
    base = torch.randn(h, c + 7, d, generator=g)  # [H, C+7, D]: the cache is the view [:, 3 : 3 + C]
    slots = torch.randperm(c, generator=g)[:t]  # [Tc], not sorted
    want_k, want_v = base.clone(), base.clone()
    want_k[:, 3:3 + c][:, slots] = ModelRunner.apply_rotation(k, cos, sin)
    want_v[:, 3:3 + c][:, slots] = v
    got_k, got_v = base.clone(), base.clone()
    cpu_kernels.place_rotated(got_k[:, 3:3 + c], got_v[:, 3:3 + c], k, v, cos, sin, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    plain_k = base.clone()
    cpu_kernels.place_rotated(plain_k[:, 3:3 + c], base.clone()[:, 3:3 + c], k, v, None, None, slots)
    assert torch.equal(plain_k[:, 3:3 + c][:, slots], k)  # no tables: the keys as they are


def test_place_rotated_refuses_what_it_cannot_take(kernel):
    K, V = torch.zeros(2, 10, 8), torch.zeros(2, 10, 8)
    k, v, cos, sin = torch.ones(2, 3, 8), torch.ones(2, 3, 8), torch.ones(3, 8), torch.ones(3, 8)
    slots = torch.tensor([0, 4, 9])
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_kernels.place_rotated(K, V, k, v, cos, sin, torch.tensor([0, 4, 10]))
    with pytest.raises(RuntimeError, match="float32 only"):
        cpu_kernels.place_rotated(K, V, k.half(), v, cos, sin, slots)
    with pytest.raises(RuntimeError, match=r"\[Tc, D\]"):
        cpu_kernels.place_rotated(K, V, k, v, cos[:2], sin[:2], slots)
    with pytest.raises(RuntimeError, match="one destination slot"):
        cpu_kernels.place_rotated(K, V, k, v, cos, sin, slots[:2])
    assert not K.any() and not V.any()  # a refused call writes nothing


@pytest.mark.parametrize(("rows", "e"), [(1, 576), (490, 576), (7, 64), (3, 100), (33, 4096)])
def test_rms_norm_equals_the_families_rmsnorm_and_each_row_stands_alone(kernel, rows, e):
    """The kernel against transformers' LlamaRMSNorm (the four families' classes share its forward) to
    float32 rounding, widths on and off the vector width; a row's output is the same alone, bit for bit."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(e)
    norm = LlamaRMSNorm(e, eps=1e-5)
    norm.weight.data = torch.randn(e, generator=g)
    x = torch.randn(rows, e, generator=g) * 3  # [R, E]
    with torch.no_grad():
        want = norm(x)
    got = cpu_kernels.rms_norm(x, norm.weight.detach(), norm.variance_epsilon)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(cpu_kernels.rms_norm(x[-1:], norm.weight.detach(), 1e-5), got[-1:])
    heads = x.view(rows, -1, 4) if e % 4 == 0 else None  # leading dims: a per-head norm's [T, H, D]
    if heads is not None:
        w4 = norm.weight.detach()[:4].contiguous()
        assert torch.equal(cpu_kernels.rms_norm(heads, w4, 1e-5).view(-1, 4), cpu_kernels.rms_norm(x.view(-1, 4), w4, 1e-5))


def test_rms_norm_refuses_what_it_cannot_take(kernel):
    with pytest.raises(RuntimeError, match="float32 only"):
        cpu_kernels.rms_norm(torch.ones(2, 8).half(), torch.ones(8).half(), 1e-6)
    with pytest.raises(RuntimeError, match=r"\[E\]"):
        cpu_kernels.rms_norm(torch.ones(2, 8), torch.ones(6), 1e-6)


def test_the_runner_normalises_through_the_kernel_and_keeps_its_outputs(kernel, monkeypatch):
    """Every RMSNorm of a step (each layer's two, the final one) goes through the kernel on the CPU in
    float32; the logits match the modules' own within float32 rounding."""
    runner = tiny_runner(kind="llama")
    ids = torch.arange(3, 40)
    with torch.inference_mode():
        hidden = runner.embed(ids)  # [T, E]
        calls = []
        real = cpu_kernels.rms_norm
        monkeypatch.setattr(cpu_kernels, "rms_norm", lambda *a: calls.append(1) or real(*a))
        fused = runner.logits(runner.finish_layer(0, hidden, torch.zeros(len(ids), runner.shape.n_heads
                                                                         * runner.shape.head_dim)))
        assert len(calls) == 2  # post-attention and final
        runner.uses_cpu_kernels = False
        plain = runner.logits(runner.finish_layer(0, hidden, torch.zeros(len(ids), runner.shape.n_heads
                                                                         * runner.shape.head_dim)))
    assert len(calls) == 2 and torch.allclose(fused, plain, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("t", "h", "d"), [(1, 9, 64), (16, 3, 64), (490, 9, 64), (7, 2, 6)])
def test_rope_rotates_fresh_rows_bit_for_bit_as_torch_in_torchs_layout(kernel, t, h, d):
    """qkv's views ([T, H, D] memory seen as [H, T, D]) rotated exactly as `x * cos + rotate_half(x) * sin`."""
    from blend_engine.model.families import rotate_half

    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, h * d, generator=g).view(t, h, d).transpose(0, 1)  # [H, T, D] over [T, H, D]
    cos, sin = torch.randn(t, d, generator=g), torch.randn(t, d, generator=g)  # [T, D]
    want = x * cos + rotate_half(x) * sin
    got = cpu_kernels.rope(x, cos, sin)
    assert torch.equal(got, want) and got.transpose(0, 1).is_contiguous()
    with pytest.raises(RuntimeError, match=r"\[T, D\]"):
        cpu_kernels.rope(x, cos[:, :2], sin[:, :2])


def test_the_runner_rotates_through_the_kernel_with_the_same_q_and_k(kernel):
    runner = tiny_runner(kind="llama")
    ids = torch.arange(3, 40)
    with torch.inference_mode():
        hidden = runner.embed(ids)  # [T, E]
        cos, sin = runner.rope(torch.arange(100, 100 + len(ids)))
        fused = runner.qkv(1, hidden, cos, sin)
        runner.uses_cpu_kernels = False
        plain = runner.qkv(1, hidden, cos, sin)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(fused, plain))  # norms: rounding


def test_the_crossover_is_where_mkl_stays_faster_not_one_noisy_probe():
    from blend_engine.model.runner import first_faster

    probes = (16, 24, 32, 48)
    assert first_faster(probes, [False, False, True, True]) == 32
    assert first_faster(probes, [False, True, False, False]) == 49  # one noisy probe: never
    assert first_faster(probes, [False, True, False, True]) == 48  # faster at the last probe counts
    assert first_faster(probes, [True, True, True, True]) == 16
    assert first_faster(probes, [False] * 4) == 49


def test_packed_rows_limit_times_both_ops_at_every_probe(kernel):
    """The measurement times the kernel on the codes and MKL on the float32 weight, each on the probe's
    rows, and takes its limit from those times (a scripted timer: the kernel costs its rows, MKL 40)."""
    from blend_engine.model.runner import PROBE_ROWS, packed_rows_limit

    layer = torch.nn.Linear(64, 96, bias=False)
    with torch.no_grad():
        layer.weight.copy_(_coded_weight(96, 64, "a4"))
    code = packed.pack(layer.weight.detach())
    calls: list[int] = []

    def timer(fn):
        out = fn()  # [T, out]
        calls.append(out.shape[0])
        return out.shape[0] if len(calls) % 2 else 40.0

    assert packed_rows_limit(layer, code, timer) == min(n for n in PROBE_ROWS if n > 40)
    assert calls == [n for n in PROBE_ROWS for _ in range(2)]


def test_float_rows_limit_times_the_kernel_against_mkl_at_every_probe(kernel):
    """The float32 kernel's measurement times `cpu_kernels.rows_linear` and MKL (`F.linear`) on each
    probe's rows, within `cpu_kernels.ROWS` (a scripted timer: the kernel costs its rows, MKL 40), and
    a layer where MKL never wins keeps the whole range."""
    from blend_engine.model.runner import FLOAT_PROBES, float_rows_limit

    assert FLOAT_PROBES and max(FLOAT_PROBES) < cpu_kernels.ROWS.stop
    layer = torch.nn.Linear(64, 96, bias=False)
    calls: list[int] = []

    def timer(fn):
        out = fn()  # [T, out]
        calls.append(out.shape[0])
        return out.shape[0] if len(calls) % 2 else 40.0

    with torch.no_grad():
        assert float_rows_limit(layer, timer) == min(n for n in FLOAT_PROBES if n > 40)
        assert calls == [n for n in FLOAT_PROBES for _ in range(2)]
        calls.clear()

        def kernel_always_faster(fn):
            fn()
            calls.append(0)
            return 0.5 if len(calls) % 2 else 1.0  # the kernel's call first, then MKL's

        assert float_rows_limit(layer, kernel_always_faster) == max(FLOAT_PROBES) + 1


def test_float_runners_measure_their_kernel_range_and_tiny_ones_keep_the_default(kernel, real_runner):
    """A float32 model with projections large enough to time (SmolLM2's, kept as float32) gets a measured
    range within `cpu_kernels.ROWS`; the tiny test models are not timed (None: `cpu_kernels.ROWS`); the
    default GGUF model has no float32 projection to time."""
    from blend_engine.model.runner import ModelRunner

    plain = ModelRunner(real_runner.model, real_runner.tokenizer, packed=False)
    assert plain.float_rows.start == cpu_kernels.ROWS.start
    assert cpu_kernels.ROWS.start < plain.float_rows.stop <= cpu_kernels.ROWS.stop
    assert tiny_runner(real_runner.tokenizer).float_rows is None
    assert real_runner.float_rows is None


def test_the_runner_sends_its_float_rows_to_the_kernel_and_more_to_mkl(kernel, real_runner, monkeypatch):
    """A float32 projection runs on `cpu_kernels.rows_linear` for its runner's `float_rows` alone, on
    F.linear (what the range was measured against) past it, with the same products."""
    from blend_engine.model.runner import ModelRunner

    runner = ModelRunner(real_runner.model, real_runner.tokenizer, packed=False, float_rows=range(3, 5))
    proj = real_runner.model.model.layers[0].mlp.gate_proj
    floats = []
    real_rows = cpu_kernels.rows_linear
    monkeypatch.setattr(cpu_kernels, "rows_linear", lambda x, *a: floats.append(x.shape[0]) or real_rows(x, *a))
    with torch.no_grad():  # as the engine runs
        for rows in (1, 3, 4, 5, 40, 100):
            x = torch.randn(rows, proj.in_features)  # [T, in]
            torch.testing.assert_close(runner.linear(proj, x), torch.nn.functional.linear(x, proj.weight),
                                       rtol=1e-5, atol=1e-5)
    assert floats == [3, 4]


def test_the_runner_sends_its_packed_rows_to_the_codes_and_more_to_mkl(kernel, real_runner, monkeypatch):
    """A measured range starts at 1 and stays within `packed.ROWS`; a runner given its range uses the
    codes for those row counts alone, and MKL (what the range was measured against) for more, not the
    float32 kernel."""
    from blend_engine.model.runner import ModelRunner

    assert real_runner.packed_rows.start == 1 and 1 < real_runner.packed_rows.stop <= packed.ROWS.stop
    runner = ModelRunner(real_runner.model, real_runner.tokenizer, packed_rows=range(1, 5))
    proj = real_runner.model.model.layers[0].mlp.gate_proj
    calls = []
    real = cpu_kernels.packed_linear
    monkeypatch.setattr(cpu_kernels, "packed_linear", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    floats = []
    real_rows = cpu_kernels.rows_linear
    monkeypatch.setattr(cpu_kernels, "rows_linear", lambda x, *a: floats.append(x.shape[0]) or real_rows(x, *a))
    with torch.no_grad():  # as the engine runs
        for rows in (1, 4, 5, 40):
            x = torch.randn(rows, proj.in_features)  # [T, in]
            torch.testing.assert_close(runner.linear(proj, x), torch.nn.functional.linear(x, proj.weight))
    assert calls == [1, 4] and floats == []
