"""The pooler: a packed ragged batch's hidden states -> one vector per request, on device.

It replaces the sampler for a pooling model. Every row chooses its pooling type,
normalization and Matryoshka width through arrays, so one program per token bucket serves
every mix of requests (nothing is static but the shapes).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from xlm.pooling_params import PoolingParams, PoolingType

_EPS = 1e-12


def pooling_metadata(
    params: Sequence[PoolingParams], num_rows: int, hidden_size: int
) -> dict[str, np.ndarray]:
    """Per-row pooling arrays for `params` padded to `num_rows` rows (host side)."""
    pooling_type = np.zeros(num_rows, np.int32)
    normalize = np.zeros(num_rows, np.bool_)
    dimensions = np.full(num_rows, hidden_size, np.int32)
    for i, p in enumerate(params):
        pooling_type[i] = int(p.pooling_type)
        normalize[i] = p.normalize and p.task == "embed"  # label scores are never normalized
        dimensions[i] = hidden_size if p.dimensions is None else p.dimensions
    return {"pooling_type": pooling_type, "normalize": normalize, "dimensions": dimensions}


def pool(
    hidden: jax.Array,
    query_start_loc: jax.Array,
    pooling_type: jax.Array,
    normalize: jax.Array,
    dimensions: jax.Array,
) -> jax.Array:
    """Pool hidden [T, H] over the requests packed by query_start_loc [R+1] -> [R, H] f32.

    Padding rows (empty spans at the end of query_start_loc) give zero vectors; padding
    tokens past the last span belong to no row. Components past a row's `dimensions` are
    zero, so its norm is the truncated vector's.
    """
    num_rows = query_start_loc.shape[0] - 1
    hidden = hidden.astype(jnp.float32)
    starts, ends = query_start_loc[:-1], query_start_loc[1:]
    lengths = ends - starts
    # Row of each token; tokens past the last span get row num_rows and are dropped.
    row_of_token = jnp.searchsorted(query_start_loc, jnp.arange(hidden.shape[0]), side="right")
    sums = jax.ops.segment_sum(hidden, row_of_token - 1, num_segments=num_rows)
    mean = sums / jnp.maximum(lengths, 1)[:, None].astype(jnp.float32)
    last = hidden[jnp.maximum(ends - 1, 0)]
    first = hidden[jnp.minimum(starts, hidden.shape[0] - 1)]
    pooled = jnp.where(
        (pooling_type == PoolingType.MEAN)[:, None],
        mean,
        jnp.where((pooling_type == PoolingType.CLS)[:, None], first, last),
    )
    keep = (jnp.arange(hidden.shape[1])[None, :] < dimensions[:, None]) & (lengths > 0)[:, None]
    pooled = jnp.where(keep, pooled, 0.0)
    norm = jnp.sqrt(jnp.sum(pooled * pooled, axis=-1, keepdims=True))
    return jnp.where(normalize[:, None], pooled / jnp.maximum(norm, _EPS), pooled)


def finish_vector(vector: np.ndarray, params: PoolingParams) -> np.ndarray:
    """A row of `pool`'s output cut to the request's width, or a classifier's label scores
    through their activation (host side)."""
    if params.task == "classify":
        return classify_activation(vector) if params.activation else vector
    return vector if params.dimensions is None else vector[: params.dimensions]


def classify_activation(logits: np.ndarray) -> np.ndarray:
    """vLLM's classifier activation: sigmoid of a single label's logit (a cross-encoder's
    relevance), softmax over several labels."""
    logits = logits.astype(np.float64)
    if logits.shape[-1] == 1:
        return (1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return (shifted / shifted.sum(axis=-1, keepdims=True)).astype(np.float32)
