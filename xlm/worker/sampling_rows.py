"""The sampler's per-request state, one persistent row per batch slot.

A request's sampling parameters are resolved into numpy rows once, when it gets a slot
(temperature, top-k/p, min-p, seed, penalties, logit bias, allowed-token mask), and its
penalty token ids grow by one entry per sampled token; a step only gathers the
scheduled slots' rows into the sampler's padded ``SamplingMetadata``. Nothing is rebuilt
from the parameters per step except the bad-word and min-tokens bans of the rows that
have them (they depend on the latest output tokens).
"""

from __future__ import annotations

import numpy as np

from xlm.sampling_params import (
    MAX_LOGIT_BIAS_TOKENS,
    SamplingParams,
    SamplingType,
    uses_output_bans,
    uses_penalties,
)
from xlm.worker.sampler import SamplingMetadata

_U32 = 0xFFFFFFFF


def split_seed(seed: int) -> tuple[int, int]:
    """A 64-bit seed as (low, high) 32-bit words."""
    return seed & _U32, (seed >> 32) & _U32


def banned_token_ids(params: SamplingParams, output_ids: list[int]) -> list[int]:
    """Tokens the next step may not sample: stop tokens before min_tokens, bad words."""
    banned: list[int] = []
    if len(output_ids) < params.min_tokens:
        banned.extend(params.all_stop_token_ids)
    for word in params.bad_words_token_ids:
        # Multi-token bad words: ban the last token only when the output ends with the rest.
        prefix = word[:-1]
        if not prefix or list(output_ids[len(output_ids) - len(prefix) :]) == prefix:
            banned.append(word[-1])
    return banned


class SamplingRows:
    """Sampler inputs for `max_rows` slots, plus one padding row (index `max_rows`)."""

    def __init__(self, max_rows: int, vocab_size: int, max_model_len: int) -> None:
        n, V, L = max_rows + 1, vocab_size, max_model_len
        self.pad_row = max_rows
        self.vocab_size = V
        self.temperature = np.ones(n, np.float32)
        self.is_greedy = np.ones(n, np.bool_)
        self.top_k = np.full(n, V, np.int32)
        self.top_p = np.ones(n, np.float32)
        self.min_p = np.zeros(n, np.float32)
        self.seeds = np.zeros((n, 2), np.uint32)
        self.has_seed = np.zeros(n, np.bool_)
        self.output_lens = np.zeros(n, np.int32)
        self.presence_penalty = np.zeros(n, np.float32)
        self.frequency_penalty = np.zeros(n, np.float32)
        self.repetition_penalty = np.ones(n, np.float32)
        # Token ids the penalties count, padded with V; written only for rows with penalties.
        self.output_token_ids = np.full((n, L), V, np.int32)
        self.prompt_token_ids = np.full((n, L), V, np.int32)
        self.logit_bias_ids = np.full((n, MAX_LOGIT_BIAS_TOKENS), V, np.int32)
        self.logit_bias_values = np.zeros((n, MAX_LOGIT_BIAS_TOKENS), np.float32)
        # Packed little-endian bits, 1 = allowed (allowed_token_ids; bans are per step).
        self.allowed_mask = np.full((n, (V + 7) // 8), 0xFF, np.uint8)
        # Which rows use each feature.
        self.has_filters = np.zeros(n, np.bool_)
        self.has_penalties = np.zeros(n, np.bool_)
        self.has_logit_bias = np.zeros(n, np.bool_)
        self.has_allowed = np.zeros(n, np.bool_)
        self.wants_logprobs = np.zeros(n, np.bool_)
        # Rows whose bans depend on their output (min_tokens, bad words): params, outputs.
        self._bans: dict[int, tuple[SamplingParams, list[int]]] = {}
        self._all_stop = np.full(L, V, np.int32)  # read-only padding blocks
        self._all_allowed = np.full(((V + 7) // 8,), 0xFF, np.uint8)
        self._grammar_free = np.full(((V + 31) // 32,), -1, np.int32)

    def add(
        self, row: int, p: SamplingParams, prompt_ids: list[int], output_ids: list[int]
    ) -> None:
        """Resolve a request's parameters into `row` (overwriting what was there).

        `output_ids` is the request's own output list: the bans read its latest tokens.
        """
        V = self.vocab_size
        greedy = p.sampling_type == SamplingType.GREEDY
        self.is_greedy[row] = greedy
        self.temperature[row] = 1.0 if greedy else p.temperature
        self.top_k[row] = V if greedy or p.top_k <= 0 else min(p.top_k, V)
        self.top_p[row] = 1.0 if greedy else p.top_p
        self.min_p[row] = 0.0 if greedy else p.min_p
        self.has_filters[row] = not greedy and (
            self.top_k[row] < V or p.top_p < 1.0 or p.min_p > 0.0
        )
        seeded = not greedy and p.seed is not None
        self.has_seed[row] = seeded
        self.seeds[row] = split_seed(p.seed) if seeded else (0, 0)
        self.output_lens[row] = len(output_ids)
        penalties = uses_penalties(p)
        self.has_penalties[row] = penalties
        self.presence_penalty[row] = p.presence_penalty if penalties else 0.0
        self.frequency_penalty[row] = p.frequency_penalty if penalties else 0.0
        self.repetition_penalty[row] = p.repetition_penalty if penalties else 1.0
        self.output_token_ids[row] = V
        self.prompt_token_ids[row] = V
        if penalties:
            self.output_token_ids[row, : len(output_ids)] = output_ids
            if p.repetition_penalty != 1.0:
                self.prompt_token_ids[row, : len(prompt_ids)] = prompt_ids
        self.has_logit_bias[row] = bool(p.logit_bias)
        self.logit_bias_ids[row] = V
        self.logit_bias_values[row] = 0.0
        if p.logit_bias:
            self.logit_bias_ids[row, : len(p.logit_bias)] = list(p.logit_bias)
            self.logit_bias_values[row, : len(p.logit_bias)] = list(p.logit_bias.values())
        self.has_allowed[row] = p.allowed_token_ids is not None
        if p.allowed_token_ids is None:
            self.allowed_mask[row] = 0xFF
        else:
            allowed = np.zeros(V, np.bool_)
            allowed[p.allowed_token_ids] = True
            self.allowed_mask[row] = np.packbits(allowed, bitorder="little")
        self.wants_logprobs[row] = p.logprobs is not None
        if uses_output_bans(p):
            self._bans[row] = (p, output_ids)
        else:
            self._bans.pop(row, None)

    def remove(self, row: int) -> None:
        """Forget a row's output-dependent bans (its arrays are overwritten by the next add)."""
        self._bans.pop(row, None)

    def append_output(self, row: int, token_id: int) -> None:
        """Count a token the row sampled."""
        n = self.output_lens[row]
        if self.has_penalties[row] and n < self.output_token_ids.shape[1]:
            self.output_token_ids[row, n] = token_id
        self.output_lens[row] = n + 1

    def metadata(
        self,
        rows: list[int] | np.ndarray,
        num_rows: int,
        step_seed: int,
        grammar_bitmask: dict[int, np.ndarray] | None = None,
        drafts: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> SamplingMetadata:
        """The padded SamplingMetadata of these slots (in this order) plus padding rows.

        ``grammar_bitmask`` maps a position in ``rows`` to its structured-output bitmask
        (int32 words); every other row allows all tokens. ``drafts`` (speculative
        decoding; a slot then fills several rows in a row, one per position) gives each
        row its proposed token (-1: none) and its offset past the slot's output length.
        """
        if len(rows) > num_rows:
            raise ValueError(f"{len(rows)} requests do not fit num_padded_reqs={num_rows}")
        idx = np.full(num_rows, self.pad_row, np.intp)
        idx[: len(rows)] = rows
        any_penalties = bool(self.has_penalties[idx].any())
        if any_penalties:
            output_ids, prompt_ids = self.output_token_ids[idx], self.prompt_token_ids[idx]
        else:  # the sampler skips penalties: constant padding, no gather
            output_ids = prompt_ids = np.broadcast_to(
                self._all_stop, (num_rows, len(self._all_stop))
            )
        mask, any_mask = self._token_mask(idx)
        grammar = np.broadcast_to(self._grammar_free, (num_rows, len(self._grammar_free)))
        if grammar_bitmask:
            grammar = grammar.copy()
            for i, words in grammar_bitmask.items():
                grammar[i] = words
        output_lens = self.output_lens[idx]
        draft_ids = np.full(num_rows, -1, np.int32)
        if drafts is not None:
            draft_ids[: len(rows)], offsets = drafts
            output_lens[: len(rows)] += offsets
        return SamplingMetadata(
            temperature=self.temperature[idx],
            is_greedy=self.is_greedy[idx],
            top_k=self.top_k[idx],
            top_p=self.top_p[idx],
            min_p=self.min_p[idx],
            seeds=self.seeds[idx],
            has_seed=self.has_seed[idx],
            output_lens=output_lens,
            presence_penalty=self.presence_penalty[idx],
            frequency_penalty=self.frequency_penalty[idx],
            repetition_penalty=self.repetition_penalty[idx],
            output_token_ids=output_ids,
            prompt_token_ids=prompt_ids,
            logit_bias_ids=self.logit_bias_ids[idx],
            logit_bias_values=self.logit_bias_values[idx],
            token_mask=mask,
            grammar_bitmask=grammar,
            step_seed=np.array(split_seed(step_seed), np.uint32),
            draft_token_ids=draft_ids,
            all_greedy=np.bool_(self.is_greedy[idx].all()),
            any_filters=np.bool_(self.has_filters[idx].any()),
            any_penalties=np.bool_(any_penalties),
            any_logit_bias=np.bool_(self.has_logit_bias[idx].any()),
            any_mask=np.bool_(any_mask),
            any_grammar=np.bool_(bool(grammar_bitmask)),
            any_logprobs=np.bool_(self.wants_logprobs[idx].any()),
            any_draft=np.bool_(bool((draft_ids >= 0).any())),
        )

    def _token_mask(self, idx: np.ndarray) -> tuple[np.ndarray, bool]:
        V = self.vocab_size
        bans = {}
        for i, row in enumerate(idx.tolist()):
            if row in self._bans:
                p, output_ids = self._bans[row]
                banned = [t for t in banned_token_ids(p, output_ids) if 0 <= t < V]
                if banned:
                    bans[i] = banned
        has_allowed = bool(self.has_allowed[idx].any())
        if not bans and not has_allowed:
            return np.broadcast_to(self._all_allowed, (len(idx), len(self._all_allowed))), False
        mask = self.allowed_mask[idx]
        for i, banned in bans.items():
            t = np.asarray(banned)
            np.bitwise_and.at(mask[i], t >> 3, ~(np.left_shift(1, t & 7)).astype(np.uint8))
        return mask, True
