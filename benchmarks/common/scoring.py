"""Answer scorers (SQuAD-normalised token F1 and exact match, Rouge-L), first-token KL and bootstrap intervals."""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np
import torch

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower-case, drop punctuation, drop a/an/the, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _tokens(text: str) -> list[str]:
    return normalize_answer(text).split()


def token_f1(prediction: str, gold: str) -> float:
    """Token-level F1 of two strings after normalisation; two empty answers score 1."""
    pred, ref = _tokens(prediction), _tokens(gold)
    if not pred or not ref:
        return float(pred == ref)
    same = sum((Counter(pred) & Counter(ref)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def max_over_golds(metric, prediction: str, golds: Iterable[str]) -> float:
    """The best score of `prediction` against any gold answer (0 when there is none)."""
    return max((metric(prediction, g) for g in golds), default=0.0)


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(P || Q) in nats of two next-token distributions given as logits [V] (computed in float64).

    Raises ValueError when the result is not finite (NaN or inf logits): a broken run must not
    read as a perfect score. Rounding below zero (identical inputs) is returned as 0.
    """
    lp, lq = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)  # [V] each
    value = float(torch.sum(lp.exp() * (lp - lq)))
    if not math.isfinite(value):
        raise ValueError(f"KL is {value}: the logits hold NaN or infinite values")
    return max(value, 0.0)


def lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    """Length of the longest common subsequence, O(len(a) * len(b)) time, O(len(b)) memory."""
    if not a or not b:
        return 0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b, 1):
            cur.append(prev[j - 1] + 1 if x == y else max(prev[j], cur[j - 1]))
        prev = cur
    return prev[-1]


def rouge_l(prediction: str, reference: str, beta: float = 1.0) -> float:
    """Rouge-L F-measure on normalised tokens: LCS-based precision and recall, weighted by beta."""
    pred, ref = _tokens(prediction), _tokens(reference)
    if not pred or not ref:
        return float(pred == ref)
    lcs = lcs_length(pred, ref)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(pred), lcs / len(ref)
    return (1 + beta**2) * precision * recall / (recall + beta**2 * precision)


def bootstrap_ci(values: Sequence[float], n_resamples: int = 1000, level: float = 0.95,
                 seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): percentile bootstrap interval of the mean."""
    arr = np.asarray(values, dtype=float)
    if arr.size == 0:
        return float("nan"), float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = arr[rng.integers(0, arr.size, size=(n_resamples, arr.size))].mean(axis=1)
    alpha = (1 - level) / 2
    low, high = np.quantile(means, [alpha, 1 - alpha])
    return float(arr.mean()), float(low), float(high)


def paired_bootstrap(a: Sequence[float], b: Sequence[float], n_resamples: int = 1000, level: float = 0.95,
                     seed: int = 0) -> tuple[float, float, float]:
    """(mean of a - b, low, high): the bootstrap interval of the paired difference."""
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length: {len(a)} vs {len(b)}")
    diff = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    return bootstrap_ci(diff, n_resamples, level, seed)
