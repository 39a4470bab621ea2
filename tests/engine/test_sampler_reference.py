"""The sampler against a reference sampler written here in float64 numpy.

Reference: p_i proportional to exp(l_i / T) over the top_k largest logits, then the nucleus: the
tokens sorted by probability, kept while the mass before them is below top_p (the smallest set
reaching top_p), renormalised. Two checks per configuration:
- exact: the probabilities `sample` hands to torch.multinomial equal the reference (1e-6);
- statistical: 10,000 draws of `sample` with a fixed seed against the reference by a chi-square test
  (deterministic: the seed is fixed, so the test cannot flake), and no draw outside the support.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from expertcache import SamplingParams
from expertcache.engine import sampler

LOGITS = [2.0, 1.5, 1.2, 0.3, -0.4, -1.0, 0.9, -3.0]  # 8 tokens, no ties

CONFIGS = [
    dict(temperature=1.0),
    dict(temperature=0.7),
    dict(temperature=1.6, top_k=3),
    dict(temperature=1.0, top_p=0.8),
    dict(temperature=0.7, top_k=5, top_p=0.8),
    dict(temperature=2.0, top_k=6, top_p=0.9),
    dict(temperature=1.0, top_p=0.31),
]


def reference(
    logits: list[float], temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> np.ndarray:
    lg = np.asarray(logits, dtype=np.float64) / temperature
    if top_k > 0:
        cut = np.sort(lg)[::-1][min(top_k, lg.size) - 1]
        lg = np.where(lg >= cut, lg, -np.inf)
    p = np.exp(lg - lg.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        keep = np.zeros(p.size, dtype=bool)
        mass = 0.0
        for i in order:
            if mass >= top_p:
                break
            keep[i] = True
            mass += p[i]
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    return p


def test_reference_by_hand():
    """The reference itself on a case worked by hand: logits ln(4), ln(3), ln(2), ln(1) at T=1 are
    0.4, 0.3, 0.2, 0.1; top_p=0.65 keeps 0.4 and 0.3 (0.4 < 0.65, 0.7 >= 0.65)."""
    lg = [math.log(4), math.log(3), math.log(2), 0.0]
    assert np.allclose(reference(lg), [0.4, 0.3, 0.2, 0.1])
    assert np.allclose(reference(lg, top_p=0.65), [4 / 7, 3 / 7, 0, 0])
    assert np.allclose(reference(lg, top_k=3), [4 / 9, 3 / 9, 2 / 9, 0])
    assert np.allclose(reference(lg, temperature=0.5), np.array([16, 9, 4, 1]) / 30)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_probabilities_equal_the_reference(monkeypatch, cfg):
    seen = []
    real = torch.multinomial

    def capture(probs, n, generator=None):
        seen.append(probs.double() / probs.double().sum())
        return real(probs, n, generator=generator)

    monkeypatch.setattr(sampler.torch, "multinomial", capture)
    sampler.sample(torch.tensor(LOGITS), SamplingParams(**cfg), torch.Generator().manual_seed(0))
    assert len(seen) == 1
    np.testing.assert_allclose(seen[0].numpy(), reference(LOGITS, **cfg), atol=1e-6, rtol=0)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_draws_follow_the_reference_distribution(cfg):
    n = 10_000
    gen = torch.Generator().manual_seed(1234)
    params = SamplingParams(**cfg)
    logits = torch.tensor(LOGITS)
    counts = np.bincount([sampler.sample(logits, params, gen) for _ in range(n)], minlength=len(LOGITS))
    p = reference(LOGITS, **cfg)
    assert counts[p == 0].sum() == 0, (counts, p)  # nothing outside the top-k / nucleus support
    support = p > 0
    expected = n * p[support]
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    if df == 0:
        return
    # Wilson-Hilferty: the chi-square quantile at z = 4.26 (p ~ 1e-5) for df degrees of freedom
    z = 4.26
    limit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    assert chi2 < limit, (chi2, limit, counts, expected)


def test_a_wrong_distribution_fails_the_same_check():
    """The chi-square check can fail: T=1 draws tested against the T=0.7 reference."""
    n = 10_000
    gen = torch.Generator().manual_seed(1234)
    counts = np.bincount(
        [sampler.sample(torch.tensor(LOGITS), SamplingParams(temperature=1.0), gen) for _ in range(n)],
        minlength=len(LOGITS),
    )
    expected = n * reference(LOGITS, temperature=0.7)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    df = len(LOGITS) - 1
    limit = df * (1 - 2 / (9 * df) + 4.26 * math.sqrt(2 / (9 * df))) ** 3
    assert chi2 > limit


def test_min_p_is_refused_not_ignored():
    with pytest.raises(TypeError, match="min_p"):
        SamplingParams(min_p=0.1)
