"""APE's attention of the question over cached passages (Yang et al., "APE: Faster and Longer
Context-Augmented Generation via Adaptive Parallel Encoding", ICLR 2025).

Passages encoded apart give the question flatter, lower-mass attention to their keys than one
sequential encoding would. APE reweights that block, for the rows that read it (the question):

    | sys (plain) | passage keys: logits / T, block mass x S | question keys (plain) |

The passage block's log-mass becomes T * logsumexp(logits / T) + log S and its distribution
softmax(logits / T); the other keys keep theirs. As one softmax over all keys, a passage key j
gets the logit l_j / T + (T - 1) * logsumexp(l / T) + log S. T = S = 1 is plain attention.
Shapes: Hq query heads, H kv heads, S rows, N keys, D head dim.
"""

from __future__ import annotations

import math

import torch


def ape_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, passage: torch.Tensor,
               scale: float, temperature: float, block_scale: float) -> torch.Tensor:
    """q [Hq, S, D] over k, v [H, N, D]; allowed [S, N] bool (True = may attend); passage [N] bool
    (the cached passages' keys, reweighted). Returns [S, Hq*D] in q's dtype."""
    group = q.shape[0] // k.shape[0]
    kk = k.repeat_interleave(group, dim=0).float()  # [Hq, N, D]
    vv = v.repeat_interleave(group, dim=0).float()  # [Hq, N, D]
    logits = (q.float() @ kk.transpose(1, 2)) * scale  # [Hq, S, N]
    logits = logits.masked_fill(~allowed, float("-inf"))  # [Hq, S, N]
    block = allowed & passage[None, :]  # [S, N]
    cooled = (logits / temperature).masked_fill(~block, float("-inf"))  # [Hq, S, N]
    lse = torch.logsumexp(cooled, dim=-1, keepdim=True)  # [Hq, S, 1]; -inf where a row sees no passage key
    lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # [Hq, S, 1]
    reweighted = cooled + (temperature - 1.0) * lse + math.log(block_scale)  # [Hq, S, N]
    logits = torch.where(block, reweighted, logits)  # [Hq, S, N]
    out = torch.softmax(logits, dim=-1) @ vv  # [Hq, S, D]
    return out.transpose(0, 1).reshape(q.shape[1], -1).to(q.dtype)  # [S, Hq*D]
