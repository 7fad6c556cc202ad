"""Scorers and bootstrap intervals against hand-checked cases."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.common.scoring import (
    bootstrap_ci,
    exact_match,
    kl,
    lcs_length,
    max_over_golds,
    normalize_answer,
    paired_bootstrap,
    rouge_l,
    token_f1,
)


def test_normalize_squad_rules():
    assert normalize_answer("The  Eiffel-Tower, in Paris!") == "eiffeltower in paris"
    assert normalize_answer("An apple a day") == "apple day"
    assert normalize_answer("  THEATRE ") == "theatre"  # 'the' only as a whole word


def test_token_f1_hand_checked():
    # pred tokens: [barack, obama]; gold: [obama] -> P=1/2, R=1 -> F1=2/3
    assert token_f1("Barack Obama", "Obama") == pytest.approx(2 / 3)
    # pred: [john, smith, jr]; gold: [john, jones] -> same=1, P=1/3, R=1/2 -> F1=0.4
    assert token_f1("John Smith Jr.", "John Jones") == pytest.approx(0.4)
    assert token_f1("the 1755", "1755") == 1.0
    assert token_f1("Paris", "London") == 0.0
    assert token_f1("", "") == 1.0
    assert token_f1("the", "Paris") == 0.0  # normalises to empty
    # repeated tokens count once each side: pred [a1 a1 b], gold [a1 b b]: same = 2, P=R=2/3
    assert token_f1("x x y", "x y y") == pytest.approx(2 / 3)


def test_exact_match_and_max_over_golds():
    assert exact_match("The United States.", "united states") == 1.0
    assert exact_match("United States of America", "united states") == 0.0
    golds = ["Adrian Edmondson", "Ade Edmondson"]
    assert max_over_golds(exact_match, "ade edmondson", golds) == 1.0
    assert max_over_golds(token_f1, "Edmondson", golds) == pytest.approx(2 / 3)
    assert max_over_golds(token_f1, "anything", []) == 0.0


def test_rouge_l_hand_checked():
    assert lcs_length("a b c d".split(), "a c d e".split()) == 3
    # pred [police, killed, gunman], ref [police, kill, gunman]: LCS 2, P=R=2/3
    assert rouge_l("police killed the gunman", "police kill the gunman") == pytest.approx(2 / 3)
    # pred [x, y] vs ref [x, z, y, w]: LCS 2, P=1, R=1/2 -> F=2/3
    assert rouge_l("x y", "x z y w") == pytest.approx(2 / 3)
    assert rouge_l("x y", "x z y w", beta=2.0) == pytest.approx(5 * 1 * 0.5 / (0.5 + 4 * 1))
    assert rouge_l("same words here", "same words here") == 1.0
    assert rouge_l("p q", "r s") == 0.0


def test_bootstrap_ci_brackets_the_mean():
    values = [0.0] * 50 + [1.0] * 50
    mean, low, high = bootstrap_ci(values, n_resamples=1000)
    assert mean == 0.5
    assert 0.35 < low < 0.5 < high < 0.65
    assert bootstrap_ci([0.7] * 10) == (0.7, pytest.approx(0.7), pytest.approx(0.7))


def test_paired_bootstrap_sees_a_consistent_gap_that_unpaired_noise_hides():
    base = [i / 20 for i in range(20)]  # wide spread between examples
    better = [b + 0.05 for b in base]  # but a constant per-example gain
    mean, low, high = paired_bootstrap(better, base)
    assert mean == pytest.approx(0.05)
    assert low == pytest.approx(0.05) and high == pytest.approx(0.05)
    with pytest.raises(ValueError):
        paired_bootstrap([1.0], [1.0, 2.0])


def test_kl_matches_the_definition_and_is_zero_for_the_same_distribution():
    p, q = torch.tensor([0.5, 0.25, 0.25]), torch.tensor([0.25, 0.25, 0.5])
    expected = 0.5 * math.log(2) + 0.25 * math.log(0.5)  # sum p log(p/q)
    assert kl(p.log(), q.log()) == pytest.approx(expected, rel=1e-6)
    assert kl(p.log() + 3.0, q.log()) == pytest.approx(expected, rel=1e-6)  # logits: shift-invariant
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    assert kl(logits, logits) == 0.0 and kl(logits, logits.flip(0)) > 0.0


def test_kl_fails_loudly_on_nan_logits():
    good = torch.zeros(4)
    with pytest.raises(ValueError, match="NaN"):
        kl(good, torch.tensor([0.0, float("nan"), 0.0, 0.0]))
    with pytest.raises(ValueError, match="NaN"):
        kl(torch.full((4,), float("nan")), good)
