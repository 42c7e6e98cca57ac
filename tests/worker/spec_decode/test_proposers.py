"""Prompt-lookup (n-gram) proposals."""

import numpy as np

from xlm.worker.spec_decode import NgramProposer


def _ngram_reference(tokens, k, min_n, max_n):
    """Plain loops: the longest suffix (max_n..min_n) with an earlier occurrence; the
    k tokens after its latest occurrence followed by k tokens, else after its first."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n :]
        starts = [s for s in range(L - n) if tokens[s : s + n] == suffix]
        if starts:
            full = [s for s in starts if s + n + k <= L]
            start = full[-1] if full else starts[0]
            return tokens[start + n : start + n + k]
    return []


def test_ngram_proposals_match_a_loop_reference():
    proposer = NgramProposer(2, 4)
    r = np.random.default_rng(3)
    for trial in range(300):
        L = int(r.integers(1, 60))
        tokens = r.integers(0, 4 if trial % 2 else 12, L).tolist()
        k = int(r.integers(1, 6))
        got = proposer.propose(np.array(tokens, np.int32), k)
        assert got == _ngram_reference(tokens, k, 2, 4), (tokens, k)


def test_ngram_proposes_the_copied_span():
    tokens = [5, 6, 7, 8, 9, 10, 1, 2, 5, 6, 7]
    assert NgramProposer(1, 3).propose(np.array(tokens), 3) == [8, 9, 10]
    assert NgramProposer(1, 3).propose(np.array([1, 2, 3]), 3) == []
    # In a loop the whole k tokens come from an earlier turn of it.
    assert NgramProposer(1, 3).propose(np.array([4] * 7), 3) == [4, 4, 4]
