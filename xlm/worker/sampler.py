"""On-device sampler: per-request logits processing, sampling and logprobs for a batch.

Shapes depend only on (number of padded requests, vocab size, max_model_len, the fixed
limits below), never on the requests' contents, and every optional feature (penalties,
logit bias, token masks, top-k/top-p/min-p, logprobs, random sampling) is switched on at
run time by a device-side boolean through ``lax.cond``: a step where no request uses a
feature skips its work, and no combination of features ever triggers a new compile.
The only static inputs are in ``SamplerConfig``, fixed for the life of an engine.

Order (vLLM v1): structured-output grammar bitmask -> logit bias -> allowed/bad-word/
min-token masks -> penalties (repetition on prompt+output tokens; presence/frequency on
output counts) -> greedy argmax, or temperature -> min_p -> top_k -> top_p -> sample.
Logprobs: like vLLM's default ``logprobs_mode="raw_logprobs"``, log_softmax of the
model's raw logits before any processing; "processed_logprobs" gives vLLM's other mode
(after every processing step, temperature and filters included, for random rows).

Whole ``sample`` at that size (benchmark in the engine report): greedy ~55 ms, random
~66 ms, +top_k ~200 ms, +top_p needing the bisection fallback ~370-435 ms: still to tune.

Measured on the 2-core dev CPU, R=64, V=49152, f32, jitted: a full-vocab ``jnp.sort``
takes ~1170 ms, ``lax.top_k(k=64)`` ~18 ms, a Gumbel/exponential race ~295 ms (threefry
bits for R*V draws), a full-vocab cumsum ~55 ms, a two-level (block) inverse CDF ~5 ms.
So random rows use a block inverse CDF, and top-k/top-p read thresholds from a
``lax.top_k`` candidate set of static size ``top_k_cap``; rows whose top-k or top-p
set is larger than that fall back (only when some row needs it) to an exact 32-step
bisection over the float bit patterns.
Tied logits at a top-k/top-p threshold are all kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.random import threefry_2x32

from xlm.sampling_params import MAX_DEVICE_LOGPROBS

_LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


@dataclass(frozen=True)
class SamplerConfig:
    """Static sampler settings (hashable: passed as a static jit argument)."""

    # Width of the top-k logprobs outputs; requests may ask for up to this many.
    max_num_logprobs: int = MAX_DEVICE_LOGPROBS
    # Size of the lax.top_k candidate set used for top-k/top-p thresholds.
    top_k_cap: int = 64
    logprobs_mode: str = "raw_logprobs"

    def __post_init__(self) -> None:
        if self.logprobs_mode not in _LOGPROBS_MODES:
            raise ValueError(
                f"SamplerConfig.logprobs_mode={self.logprobs_mode!r} is invalid: "
                f"allowed {_LOGPROBS_MODES}"
            )


@jax.tree_util.register_dataclass
@dataclass
class SamplingMetadata:
    """Per-request sampling arrays for R padded rows (numpy on host, jax on device)."""

    temperature: Any  # f32[R]; 1.0 for greedy and padding rows
    is_greedy: Any  # bool[R]
    top_k: Any  # i32[R]; V when off
    top_p: Any  # f32[R]
    min_p: Any  # f32[R]
    seeds: Any  # u32[R, 2] (low, high 32 bits); zeros when unseeded
    has_seed: Any  # bool[R]
    output_lens: Any  # i32[R]: tokens generated so far (folded into the random key)
    presence_penalty: Any  # f32[R]
    frequency_penalty: Any  # f32[R]
    repetition_penalty: Any  # f32[R]
    output_token_ids: Any  # i32[R, max_model_len]; padded with V (rows with penalties only)
    prompt_token_ids: Any  # i32[R, max_model_len]; padded with V (repetition penalty only)
    logit_bias_ids: Any  # i32[R, MAX_LOGIT_BIAS_TOKENS]; padded with V
    logit_bias_values: Any  # f32[R, MAX_LOGIT_BIAS_TOKENS]
    token_mask: Any  # u8[R, ceil(V/8)]: packed little-endian bits, 1 = token allowed
    # i32[R, ceil(V/32)]: structured-output bitmask, bit i of word w = token 32w+i allowed;
    # -1 (all allowed) on free rows.
    grammar_bitmask: Any
    step_seed: Any  # u32[2]: the engine's per-step seed for unseeded rows
    # Speculative decoding: the proposed token this row verifies (-1: none; the row then
    # samples as usual). See ``sample``.
    draft_token_ids: Any  # i32[R]
    # Device-side feature switches (bool scalars): select lax.cond branches at run time.
    all_greedy: Any
    any_filters: Any
    any_penalties: Any
    any_logit_bias: Any
    any_mask: Any
    any_grammar: Any
    any_logprobs: Any
    any_draft: Any


@jax.tree_util.register_dataclass
@dataclass
class SamplerOutput:
    """What leaves the device: sampled ids, their logprobs and ranks, and the top-k."""

    sampled_token_ids: Any  # i32[R]
    logprobs: Any  # f32[R]: logprob of the sampled token (0 when no row asked)
    ranks: Any  # i32[R]: 1-based rank of the sampled token
    topk_ids: Any  # i32[R, K]
    topk_logprobs: Any  # f32[R, K]
    # Speculative decoding: whether the row's proposed token was accepted (then it is the
    # row's token); False on rows without one.
    accepted: Any  # bool[R]


# -- host side: xlm.worker.sampling_rows builds SamplingMetadata from per-slot rows -----------


# -- device side --------------------------------------------------------------------------


def row_uniforms(md: SamplingMetadata) -> tuple[jax.Array, jax.Array]:
    """Two independent uniforms in [0, 1) per row: the draw that samples the row's token
    and the one that accepts or rejects its proposed token (speculative decoding).

    One Threefry-2x32 block per row, keyed by the request's 64-bit seed (or the engine's
    per-step seed, which changes every step) and counting the row's output length (and, for
    an unseeded row, its row): a seeded request draws the same at the same position in any
    batch. One block gives both words, where deriving a key per use (fold_in chains) costs
    a block each and makes the program several times larger to compile.
    """
    R = md.output_lens.shape[0]
    rows = jnp.arange(1, R + 1, dtype=jnp.uint32)
    k0 = jnp.where(md.has_seed, md.seeds[:, 0], md.step_seed[0])
    k1 = jnp.where(md.has_seed, md.seeds[:, 1], md.step_seed[1])
    counts = jnp.stack(
        [md.output_lens.astype(jnp.uint32), jnp.where(md.has_seed, jnp.uint32(0), rows)], -1
    )
    bits = jax.vmap(lambda a, b, c: threefry_2x32((a, b), c))(k0, k1, counts)  # [R, 2]
    # 23 random mantissa bits under the exponent of 1.0: a float in [1, 2), minus one.
    one = jax.lax.bitcast_convert_type((bits >> 9) | jnp.uint32(0x3F800000), jnp.float32) - 1.0
    return one[:, 0], one[:, 1]


def _apply_penalties(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    R, V = logits.shape
    rows = jnp.arange(R)[:, None]
    out_counts = jnp.zeros((R, V), jnp.int32).at[rows, md.output_token_ids].add(1, mode="drop")
    prompt_seen = jnp.zeros((R, V), jnp.bool_).at[rows, md.prompt_token_ids].set(True, mode="drop")
    out_seen = out_counts > 0
    rep = jnp.where(prompt_seen | out_seen, md.repetition_penalty[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = logits - md.frequency_penalty[:, None] * out_counts.astype(logits.dtype)
    return logits - md.presence_penalty[:, None] * out_seen.astype(logits.dtype)


def _apply_logit_bias(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, md.logit_bias_ids].add(md.logit_bias_values, mode="drop")


def _apply_grammar_bitmask(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """-inf for every token a row's structured-output bitmask does not allow."""
    R, V = logits.shape
    shifts = jnp.arange(32, dtype=jnp.int32)
    bits = (md.grammar_bitmask[:, :, None] >> shifts) & 1  # [R, W, 32]
    allowed = bits.reshape(R, -1)[:, :V].astype(jnp.bool_)
    return jnp.where(allowed, logits, -jnp.inf)


def _apply_mask(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    bits = jnp.unpackbits(md.token_mask, axis=-1, bitorder="little")[:, : logits.shape[-1]]
    return jnp.where(bits.astype(jnp.bool_), logits, -jnp.inf)


def _sortable_keys(x: jax.Array) -> jax.Array:
    """int32 keys with the same order as the float32 values."""
    i = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(i < 0, i ^ jnp.int32(0x7FFFFFFF), i)


def _bisect_threshold(keys: jax.Array, weights: jax.Array, target: jax.Array) -> jax.Array:
    """Per row, the largest key t with sum(weights[keys >= t]) >= target (exact, 32 steps)."""
    lo = jnp.full(keys.shape[:1], jnp.iinfo(jnp.int32).min, jnp.int32)
    hi = jnp.full(keys.shape[:1], jnp.iinfo(jnp.int32).max, jnp.int32)

    def body(_: int, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = carry
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)
        ok = jnp.sum(jnp.where(keys >= mid[:, None], weights, 0.0), axis=-1) >= target
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = jax.lax.fori_loop(0, 32, body, (lo, hi))
    return lo


def _apply_filters(x: jax.Array, md: SamplingMetadata, cap: int) -> jax.Array:
    """min_p, then top_k, then top_p (on the renormalized top-k set), on scaled logits."""
    R, V = x.shape
    cap = min(cap, V)
    probs = jax.nn.softmax(x, axis=-1)
    max_prob = jnp.max(probs, axis=-1, keepdims=True)
    x = jnp.where(probs < md.min_p[:, None] * max_prob, -jnp.inf, x)

    top_k = jnp.clip(md.top_k, 1, V)
    vals, _ = jax.lax.top_k(x, cap)  # sorted descending
    k_fast = top_k <= cap
    thr_k = jnp.take_along_axis(vals, jnp.minimum(top_k, cap)[:, None] - 1, axis=-1)[:, 0]
    thr_k = jnp.where(top_k >= V, -jnp.inf, thr_k)

    def exact_top_k() -> jax.Array:
        t = _bisect_threshold(_sortable_keys(x), jnp.ones_like(x), top_k.astype(x.dtype))
        slow = jnp.where(
            top_k >= V,
            -jnp.inf,
            jnp.min(jnp.where(_sortable_keys(x) >= t[:, None], x, jnp.inf), -1),
        )
        return jnp.where(k_fast, thr_k, slow)

    thr_k = jax.lax.cond(jnp.all(k_fast | (top_k >= V)), lambda: thr_k, exact_top_k)
    x = jnp.where(x < thr_k[:, None], -jnp.inf, x)

    m = jnp.max(x, axis=-1, keepdims=True)
    unnorm = jnp.exp(x - m)
    total = jnp.sum(unnorm, axis=-1)
    cand = jnp.where(vals >= thr_k[:, None], jnp.exp(vals - m), 0.0) / total[:, None]
    cum = jnp.cumsum(cand, axis=-1)
    idx = jnp.sum(cum < md.top_p[:, None], axis=-1)
    off = md.top_p >= 1.0
    p_fast = off | (idx < cap)
    thr_p = jnp.take_along_axis(vals, jnp.minimum(idx, cap - 1)[:, None], axis=-1)[:, 0]
    thr_p = jnp.where(off, -jnp.inf, thr_p)

    def exact_top_p() -> jax.Array:
        keys = _sortable_keys(x)
        t = _bisect_threshold(keys, unnorm / total[:, None], md.top_p)
        slow = jnp.min(jnp.where(keys >= t[:, None], x, jnp.inf), axis=-1)
        return jnp.where(p_fast, thr_p, slow)

    thr_p = jax.lax.cond(jnp.all(p_fast), lambda: thr_p, exact_top_p)
    return jnp.where(x < thr_p[:, None], -jnp.inf, x)


def _random_logits(logits: jax.Array, md: SamplingMetadata, cap: int) -> jax.Array:
    """Temperature-scaled and filtered logits (what random rows sample from)."""
    x = logits / md.temperature[:, None]
    return jax.lax.cond(md.any_filters, lambda: _apply_filters(x, md, cap), lambda: x)


def _argmax(x: jax.Array) -> jax.Array:
    """First index of the row maximum, in two levels (blocks, then one block).

    XLA:CPU lowers argmax to a slow variadic reduce (~20 ms at 64 x 49152); a plain max
    over the row plus an argmax over block maxima and one block is ~15x cheaper.
    """
    R, V = x.shape
    block = 256 if V >= 4096 else V
    num_blocks = -(-V // block)
    if num_blocks * block != V:
        x = jnp.pad(x, ((0, 0), (0, num_blocks * block - V)), constant_values=-jnp.inf)
    blocks = x.reshape(R, num_blocks, block)
    best_block = jnp.argmax(jnp.max(blocks, axis=-1), axis=-1)
    inside = jnp.take_along_axis(blocks, best_block[:, None, None], axis=1)[:, 0]
    idx = best_block * block + jnp.argmax(inside, axis=-1)
    return jnp.minimum(idx, V - 1).astype(jnp.int32)


def _verify_random(x: jax.Array, md: SamplingMetadata, u: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Rejection sampling of deterministic proposals (xlm's proposers propose one token
    per position, a point mass q): accept draft d with probability min(1, p(d)/q(d)) =
    p(d); on rejection draw from the residual max(0, p - q), which is p without d,
    renormalized; `u`: each row's acceptance uniform. Returns (the logits to draw the row's
    token from, accepted)."""
    V = x.shape[-1]
    draft = md.draft_token_ids
    has_draft = draft >= 0
    safe = jnp.maximum(draft, 0)
    logp = x - jax.nn.logsumexp(x, axis=-1, keepdims=True)
    p_draft = jnp.exp(jnp.take_along_axis(logp, safe[:, None], axis=-1)[:, 0])
    accepted = has_draft & (u < p_draft)
    is_draft = has_draft[:, None] & (jnp.arange(V)[None, :] == draft[:, None])
    residual = jnp.where(is_draft, -jnp.inf, x)
    # p(d) = 1 leaves no residual; the draft is then always accepted and the draw unused.
    empty = ~jnp.any(residual > -jnp.inf, axis=-1, keepdims=True)
    return jnp.where(empty, x, residual), accepted


def _sample_random(x: jax.Array, u: jax.Array) -> jax.Array:
    """Inverse-CDF sampling with one uniform draw `u` per row.

    Two-level search (block sums, then one block) instead of a full-vocab cumsum, which
    XLA:CPU runs ~10x slower.
    """
    R, V = x.shape
    num_blocks = min(256, V)
    block = -(-V // num_blocks)
    unnorm = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
    padded = jnp.pad(unnorm, ((0, 0), (0, num_blocks * block - V))).reshape(R, num_blocks, block)
    block_sums = jnp.sum(padded, axis=-1)
    block_cdf = jnp.cumsum(block_sums, axis=-1)
    target = u * block_cdf[:, -1]
    b = jnp.minimum(jnp.sum(block_cdf <= target[:, None], axis=-1), num_blocks - 1)
    before = jnp.take_along_axis(block_cdf - block_sums, b[:, None], axis=-1)[:, 0]
    in_block = jnp.take_along_axis(padded, b[:, None, None], axis=1)[:, 0]
    cdf = jnp.cumsum(in_block, axis=-1)
    i = jnp.minimum(jnp.sum(cdf <= (target - before)[:, None], axis=-1), block - 1)
    idx = jnp.minimum(b * block + i, V - 1).astype(jnp.int32)
    # Float rounding can land on a zero-probability token: take the most likely one then.
    chosen = jnp.take_along_axis(unnorm, idx[:, None], axis=-1)[:, 0]
    return jnp.where(chosen > 0, idx, _argmax(x))


def compute_logprobs(
    logprobs: jax.Array, token_ids: jax.Array, num_logprobs: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """From log-probs [N, V]: the tokens' logprobs [N], 1-based ranks [N], top-k ids/logprobs."""
    lp = jnp.take_along_axis(logprobs, token_ids[:, None], axis=-1)[:, 0]
    ranks = jnp.sum(logprobs >= lp[:, None], axis=-1).astype(jnp.int32)
    N, V = logprobs.shape
    k = min(num_logprobs, V)
    top_lps, top_ids = jax.lax.top_k(logprobs, k) if k else (logprobs[:, :0], jnp.zeros((N, 0)))
    if k < num_logprobs:  # a vocabulary smaller than the output width: pad the columns
        top_lps = jnp.pad(top_lps, ((0, 0), (0, num_logprobs - k)), constant_values=-jnp.inf)
        top_ids = jnp.pad(top_ids, ((0, 0), (0, num_logprobs - k)))
    return lp, ranks, top_ids.astype(jnp.int32), top_lps


def compute_prompt_logprobs(
    logits: jax.Array, next_token_ids: jax.Array, num_logprobs: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Prompt logprobs: for logits [N, V] at prompt positions and the next prompt tokens [N]."""
    return compute_logprobs(jax.nn.log_softmax(logits, axis=-1), next_token_ids, num_logprobs)


def process_logits(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """Grammar bitmask, logit bias, token masks, penalties (everything before temperature)."""
    logits = jax.lax.cond(md.any_grammar, _apply_grammar_bitmask, lambda x, _: x, logits, md)
    logits = jax.lax.cond(md.any_logit_bias, _apply_logit_bias, lambda x, _: x, logits, md)
    logits = jax.lax.cond(md.any_mask, _apply_mask, lambda x, _: x, logits, md)
    return jax.lax.cond(md.any_penalties, _apply_penalties, lambda x, _: x, logits, md)


def sample(logits: jax.Array, md: SamplingMetadata, config: SamplerConfig) -> SamplerOutput:
    """Sample one token per row of ``logits`` [R, V] (f32); jit with ``config`` static.

    A step whose rows are all greedy and ask for nothing else (no logits processing,
    logprobs or proposals) takes the argmax alone: the full path's conditionals pass the
    [R, V] logits through their branches, and with the random branch's sort in the
    program XLA:CPU spent 3.5-3.8 ms on them at 64 rows of SmolLM2's 49152 (the argmax
    alone: 0.2 ms; RESULTS.md, session 18)."""
    logits = logits.astype(jnp.float32)
    only_argmax = md.all_greedy & ~(
        md.any_grammar
        | md.any_logit_bias
        | md.any_mask
        | md.any_penalties
        | md.any_logprobs
        | md.any_draft
    )
    return jax.lax.cond(
        only_argmax,
        lambda: _argmax_only(logits, config),
        lambda: _sample_full(logits, md, config),
    )


def _no_logprobs(R: int, config: SamplerConfig) -> tuple[jax.Array, ...]:
    """The logprob outputs of rows that asked for none: zeros."""
    K = config.max_num_logprobs
    return (
        jnp.zeros(R, jnp.float32),
        jnp.zeros(R, jnp.int32),
        jnp.zeros((R, K), jnp.int32),
        jnp.zeros((R, K), jnp.float32),
    )


def _argmax_only(logits: jax.Array, config: SamplerConfig) -> SamplerOutput:
    """`_sample_full`'s output for greedy rows with nothing else asked."""
    R = logits.shape[0]
    return SamplerOutput(
        _argmax(logits), *_no_logprobs(R, config), accepted=jnp.zeros(R, jnp.bool_)
    )


def _sample_full(logits: jax.Array, md: SamplingMetadata, config: SamplerConfig) -> SamplerOutput:
    raw = logits
    logits = process_logits(logits, md)
    greedy_ids = _argmax(logits)
    processed_mode = config.logprobs_mode == "processed_logprobs"

    no_accept = jnp.zeros(logits.shape[0], jnp.bool_)

    def random_branch() -> tuple[jax.Array, jax.Array, jax.Array]:
        x = _random_logits(logits, md, config.top_k_cap)
        u_draw, u_accept = row_uniforms(md)
        draw_from, accepted = jax.lax.cond(
            md.any_draft, _verify_random, lambda x, *_: (x, no_accept), x, md, u_accept
        )
        return _sample_random(draw_from, u_draw), x, accepted

    def greedy_branch() -> tuple[jax.Array, jax.Array, jax.Array]:
        return greedy_ids, logits, no_accept

    random_ids, scaled, random_accepted = jax.lax.cond(md.all_greedy, greedy_branch, random_branch)
    # Speculative decoding: a greedy row accepts its proposal when it is the argmax; a
    # row's token is its accepted proposal, else what it drew (the correction, or the
    # bonus token of a row with no proposal).
    draft = md.draft_token_ids
    accepted = jnp.where(md.is_greedy, (draft >= 0) & (greedy_ids == draft), random_accepted)
    sampled = jnp.where(md.is_greedy, greedy_ids, random_ids)
    sampled = jnp.where(accepted, draft, sampled)

    def with_logprobs() -> tuple[jax.Array, ...]:
        if processed_mode:
            source = jnp.where(md.is_greedy[:, None], logits, scaled)
        else:
            source = raw
        return compute_logprobs(
            jax.nn.log_softmax(source, axis=-1), sampled, config.max_num_logprobs
        )

    lp, ranks, top_ids, top_lps = jax.lax.cond(
        md.any_logprobs, with_logprobs, lambda: _no_logprobs(logits.shape[0], config)
    )
    return SamplerOutput(sampled, lp, ranks, top_ids, top_lps, accepted)


sample_jit = jax.jit(sample, static_argnames=("config",))
