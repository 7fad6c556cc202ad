"""Issue #28's oracle bound: the best that any selection of R of the cached passages' tokens could
do, measured in the length sweep (`benchmarks.quality.lengths`, variants "oracle-...").

    | sys | passage_1 .. passage_k | question |
      exact   compete: ranked by the TRUE deviation   forced (recomputed), as in a blend

Per question (and passage length) the full prefill's and full reuse's caches of the same prompt
are computed once (`OracleRefs`); the competing tokens are ranked by their true K/V deviation
(`oracle_seam.true_deviation`: squared L2 per layer, K and V each divided by their mean over
the competing tokens, summed over layers 1..L-1; layer 0 is rounding only), or by that times the
attention the full prefill's question pays each token at each layer ("qa"), or by how much giving
it the exact K/V lowers the first token's KL ("ig": integrated gradients of that KL along the
straight path from the cached K/V to the exact ones, with the question prefilled over the cache as
"fix" does; the attributions sum to full reuse's KL). The top
`budget.kept(n_compete, R)` (the default policy's final keep count at ratio R) are then:

- "select": recomputed at every layer after the check layer (a blend with that fixed selection);
- "select-sched": the default's per-layer counts (4x the ratio at the check layer, narrowed to 2x,
  1.5x, 1x by layer 4), each the top of the oracle's ranking;
- "fix": given the full prefill's exact K/V at every layer, the rest cached; the question is
  prefilled over that cache (no recomputation can beat the exact values).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from benchmarks.common.policies import PREVIOUS_DEFAULT
from benchmarks.quality.oracle_seam import Oracle, top_positions, true_deviation
from blend_engine.engine import BlendEngine
from blend_engine.executor.layers import KVCache
from blend_engine.executor.selection import RankSpace
from blend_engine.layout import PromptLayout
from blend_engine.model.runner import ModelRunner
from blend_engine.scheduler.budget import kept, narrowing
from blend_engine.types import BlendPlan

# the true deviation; x the full prefill's question attention; integrated gradients of the first
# token's KL along the path from the cached K/V to the exact ones ("fix"'s own objective)
RANKS = ("deviation", "qa", "ig")


@dataclass(frozen=True)
class OracleRefs:
    """What every oracle run of one prompt needs, computed once."""

    compete: torch.Tensor  # [P] the competing (cached passage) positions
    n_compete: int  # competitors that are not forced (no sinks here: P)
    scores: dict[str, torch.Tensor]  # rank -> [P]
    exact: KVCache  # the full prefill's cache
    n_tokens: int
    question_logits: torch.Tensor  # [V] the question pass over the exact cache (a check of `question_mass`)


def _question_layers(r: ModelRunner, K: list[torch.Tensor], V: list[torch.Tensor], layout: PromptLayout,
                     own_kv: bool, masses: list[torch.Tensor] | None = None) -> torch.Tensor:
    """The question (the last segment) through every layer over a cache K, V (L x [H, >= N, D]):
    the context's keys from the cache, the question's own fresh (`own_kv`, as full_reuse does) or
    from the cache too. With `masses`, each layer's attention the question pays each position is
    appended (summed over heads and queries, [N]). Its last position's logits [V]."""
    N, last = layout.n_tokens, layout.segments[-1]
    qpos = torch.arange(last.offset, last.end, device=r.device)  # [Q]
    hidden = r.embed(torch.tensor(layout.token_ids(), device=r.device)[qpos])  # [Q, E]
    cos, sin = r.rope(qpos)  # [Q, D] each
    allowed = torch.arange(N, device=r.device)[None, :] <= qpos[:, None]  # [Q, N] causal
    for layer in range(r.shape.n_layers):
        q, k, v = r.qkv(layer, hidden, cos, sin)  # [Hq, Q, D], [H, Q, D] x2
        if own_kv:
            keys = torch.cat([K[layer][:, :last.offset], k], dim=1)  # [H, N, D]
            values = torch.cat([V[layer][:, :last.offset], v], dim=1)  # [H, N, D]
        else:
            keys, values = K[layer][:, :N], V[layer][:, :N]  # [H, N, D] each
        if masses is not None:
            H, Q, D = keys.shape[0], qpos.shape[0], keys.shape[2]
            group = q.shape[0] // H
            logits = (q.float().reshape(H, group * Q, D) @ keys.float().transpose(1, 2)) * r.scaling  # [H, G*Q, N]
            logits = logits.masked_fill(~allowed.repeat(group, 1), float("-inf"))  # [H, G*Q, N]
            masses.append(torch.softmax(logits, dim=-1).sum(dim=(0, 1)))  # [N]
        hidden = r.finish_layer(layer, hidden, r.attend(q, keys, values, allowed))  # [Q, E]
    return r.logits(hidden[-1:])[0]  # [V]


def _full_attention_only(r: ModelRunner, what: str) -> None:
    if any(w is not None for w in r.windows):
        raise ValueError(f"{what} handles full attention only (no sliding-window layers)")


@torch.inference_mode()
def question_mass(r: ModelRunner, exact: KVCache, layout: PromptLayout) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The full prefill's question (the last segment) through every layer over the exact cache: per
    layer the attention its queries pay each position, summed over heads and queries, L x [N]; and
    its last position's logits [V] (equal to full prefill's: a check)."""
    _full_attention_only(r, "question_mass")
    masses: list[torch.Tensor] = []
    logits = _question_layers(r, exact.k, exact.v, layout, own_kv=False, masses=masses)
    return masses, logits


def question_pass(r: ModelRunner, K: list[torch.Tensor], V: list[torch.Tensor], layout: PromptLayout) -> torch.Tensor:
    """The question (the last segment) prefilled over a given cache of the context, as full_reuse
    does (its own K/V fresh at every layer, the rest read from K, V: L x [H, N, D]); differentiable
    in K and V. Its last position's logits [V]."""
    return _question_layers(r, K, V, layout, own_kv=True)


def integrated_gradients(r: ModelRunner, full: KVCache, reuse: KVCache, layout: PromptLayout,
                         positions: torch.Tensor, steps: int = 8) -> torch.Tensor:
    """Per position in `positions` [P]: how much giving it the exact K/V lowers the first token's KL
    to full prefill, by integrated gradients along the straight path from the cached K/V (full
    reuse) to the exact ones (full prefill), both known; with the question prefilled over the cache
    as "fix" does. Summed over every position (and the others) the attributions are KL(reuse) -
    KL(exact) up to the path's discretisation (`steps` midpoints): [P], higher = fixing helps more."""
    _full_attention_only(r, "integrated_gradients")
    N, L = layout.n_tokens, r.shape.n_layers
    base_k = [reuse.k[lay][:, :N].clone() for lay in range(L)]  # [H, N, D] each (normal tensors: autograd)
    base_v = [reuse.v[lay][:, :N].clone() for lay in range(L)]
    dk = [full.k[lay][:, :N].clone() - base_k[lay] for lay in range(L)]  # [H, N, D] each
    dv = [full.v[lay][:, :N].clone() - base_v[lay] for lay in range(L)]
    with torch.no_grad():
        target = torch.log_softmax(question_pass(r, [b + d for b, d in zip(base_k, dk)],
                                                 [b + d for b, d in zip(base_v, dv)], layout).double(), -1)  # [V]
    total = torch.zeros(N, dtype=torch.float64, device=positions.device)  # [N]
    with torch.enable_grad():
        for step in range(steps):
            alpha = (step + 0.5) / steps
            ks = [(b + alpha * d).requires_grad_() for b, d in zip(base_k, dk)]
            vs = [(b + alpha * d).requires_grad_() for b, d in zip(base_v, dv)]
            logq = torch.log_softmax(question_pass(r, ks, vs, layout).double(), -1)  # [V]
            loss = torch.sum(target.exp() * (target - logq))  # KL(exact || this cache)
            grads = torch.autograd.grad(loss, ks + vs)
            for g, d in zip(grads, dk + dv):
                total -= (g.double() * d.double()).sum(dim=(0, 2))  # [N]: minus the KL change along the path
    return (total / steps)[positions].float()  # [P]


@torch.inference_mode()
def oracle_refs(engine: BlendEngine, plan: BlendPlan) -> OracleRefs:
    """Full prefill's and full reuse's caches of `plan`'s prompt (its passages must be cached), the
    competing positions and their rankings."""
    full = engine.prefill(dataclasses.replace(plan, mode="full_prefill"), max_new_tokens=1)
    reuse = engine.prefill(dataclasses.replace(plan, mode="full_reuse"), max_new_tokens=1)
    prep = engine.prepare(dataclasses.replace(plan, mode="blend"), 1)
    if prep.mp.misses:
        raise RuntimeError("the oracle needs every passage cached (a miss is recomputed, not ranked)")
    space = RankSpace(prep.layout, [s for s, _ in prep.mp.cached], engine.runner.scaling, device=engine.runner.device)
    masses, q_logits = question_mass(engine.runner, full.cache, prep.layout)
    dev = true_deviation(full.cache, reuse.cache, space.compete)  # [P]
    qa = true_deviation(full.cache, reuse.cache, space.compete, weights=[m[space.compete] for m in masses])  # [P]
    with torch.inference_mode(False):
        ig = integrated_gradients(engine.runner, full.cache, reuse.cache, prep.layout, space.compete)  # [P]
    return OracleRefs(space.compete, space.n_compete, {"deviation": dev, "qa": qa, "ig": ig}, full.cache,
                      prep.layout.n_tokens, q_logits)


@torch.inference_mode()
def oracle_first_token(engine: BlendEngine, plan: BlendPlan, refs: OracleRefs, mode: str, rank: str,
                       ratio: float) -> tuple[torch.Tensor, int]:
    """One oracle run's first-token logits [V] and the tokens it recomputed or corrected (the
    question, and the chosen ones; a select also every token up to the check layer, not counted)."""
    if mode == "select-sched":  # the default's per-layer counts (4x > 2x > 1.5x > 1x), ranked by the oracle
        policy = PREVIOUS_DEFAULT
        order = refs.compete[torch.argsort(refs.scores[rank], descending=True)]  # [P] best first
        schedule = tuple((layer, kept(refs.n_compete, ratio, mult)) for layer, mult in sorted(narrowing(policy).items()))
        blend = dataclasses.replace(plan, mode="blend", recompute_ratio=ratio, policy=policy)
        state = engine.prefill(blend, max_new_tokens=1, hooks=Oracle("select", order[:schedule[0][1]], schedule=schedule))
        return state.logits, state.report.recomputed_tokens
    chosen = top_positions(refs.scores[rank], refs.compete, kept(refs.n_compete, ratio))  # [R]
    if mode == "select":
        blend = dataclasses.replace(plan, mode="blend", recompute_ratio=ratio, policy=PREVIOUS_DEFAULT)
        state = engine.prefill(blend, max_new_tokens=1, hooks=Oracle("select", chosen))
        return state.logits, state.report.recomputed_tokens
    state = engine.prefill(dataclasses.replace(plan, mode="full_reuse"), max_new_tokens=1,
                           hooks=Oracle("fix", chosen, refs.exact))
    return state.logits, state.report.recomputed_tokens + int(chosen.shape[0])


class LazyRefs:
    """`oracle_refs` of one prompt, computed on the first call (only when an oracle variant runs)."""

    def __init__(self, engine: BlendEngine, plan: BlendPlan) -> None:
        self.engine, self.plan = engine, plan
        self._refs: OracleRefs | None = None

    def __call__(self) -> OracleRefs:
        if self._refs is None:
            self._refs = oracle_refs(self.engine, self.plan)
        return self._refs


__all__ = ["RANKS", "LazyRefs", "OracleRefs", "integrated_gradients", "oracle_first_token", "oracle_refs",
           "question_mass", "question_pass"]
