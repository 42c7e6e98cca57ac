"""Proposers: what proposes the tokens a step verifies (prompt lookup here; a draft
model in xlm.worker.spec_decode.draft)."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from xlm.config import SpeculativeConfig


class Proposer(Protocol):
    """Proposes tokens to follow the known tokens of requests of the runner's batch."""

    def propose_batch(self, batch: Any, wanted: dict[str, int]) -> dict[str, list[int]]:
        """Up to `wanted[req_id]` tokens for each request (fewer, or none, allowed)."""
        ...

    def seconds_per_round(self, num_requests: int) -> float:
        """What proposing one more token to each of `num_requests` requests costs."""
        ...


class NgramProposer:
    """Prompt lookup: the longest suffix of n tokens (max_n down to min_n) seen earlier in
    the request proposes the k tokens that followed its latest earlier occurrence with k
    tokens after it (else the earliest occurrence's)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, tokens: np.ndarray, k: int) -> list[int]:
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[length - n :]
            # Windows of n tokens that end before the last token (so something follows).
            windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                # The latest occurrence with k tokens after it; else the earliest (in a
                # loop the latest overlaps the suffix and has only a token or two after).
                full = hits[hits + n + k <= length]
                start = int(full[-1] if full.size else hits[0]) + n
                return tokens[start : start + k].tolist()
        return []

    def propose_batch(self, batch: Any, wanted: dict[str, int]) -> dict[str, list[int]]:
        out = {}
        for req_id, k in wanted.items():
            slot = batch.requests[req_id].slot
            out[req_id] = self.propose(batch.token_ids[slot, : batch.num_tokens[slot]], k)
        return out

    def seconds_per_round(self, num_requests: int) -> float:
        return 0.0  # a host lookup: nothing next to a step


def make_ngram_proposer(config: SpeculativeConfig) -> Proposer:
    """Prompt lookup with the config's n-gram sizes (a draft model's proposer needs its own
    runner: xlm.worker.worker builds it)."""
    if config.method != "ngram":
        raise ValueError(f"SpeculativeConfig.method={config.method!r} is not 'ngram'")
    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
