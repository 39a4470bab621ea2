"""sampler.prompt_logprobs in row blocks equals a float64 log-softmax of the whole [n, V] at once."""

from __future__ import annotations

import pytest
import torch

from expertcache.engine import sampler


@pytest.mark.parametrize("n", [1, sampler.PROMPT_LOGPROB_ROWS, 2 * sampler.PROMPT_LOGPROB_ROWS + 7])
def test_row_blocks_equal_the_whole_log_softmax(n):
    g = torch.Generator().manual_seed(n)
    logits = torch.randn(n, 50, generator=g) * 4
    targets = torch.randint(0, 50, (n - 1,), generator=g).tolist() if n > 1 else [3]
    got = sampler.prompt_logprobs(logits, targets, 3)
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert [e[0] for e in got] == targets
    for i, (tok, lp, top) in enumerate(got):
        assert lp == pytest.approx(ref[i, tok].item(), abs=1e-5)
        want = torch.topk(ref[i], 3)
        assert [t for t, _ in top] == want.indices.tolist()
        assert [v for _, v in top] == pytest.approx(want.values.tolist(), abs=1e-5)
