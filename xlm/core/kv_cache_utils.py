"""Stable block hashing for prefix caching: sha256 over parent hash, token ids, extra keys."""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from xlm.core.request import Request

# A block hash is a sha256 digest (32 bytes): stable across processes, hosts and runs,
# unlike Python's hash(), so process 0 and replicas agree and a cache can be persisted.
BlockHash = bytes

# Parent of a request's first block.
NONE_HASH: BlockHash = hashlib.sha256(b"xlm.none_hash").digest()

_SWAP = sys.byteorder != "little"


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    arr = array("q", token_ids)
    if _SWAP:
        arr.byteswap()
    return arr.tobytes()


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    """Hash one full block: chains the parent's hash, the token ids and extra keys."""
    h = hashlib.sha256(NONE_HASH if parent_hash is None else parent_hash)
    h.update(len(token_ids).to_bytes(4, "little"))
    h.update(_token_bytes(token_ids))
    if extra_keys:
        # repr() of str/int/tuple values is deterministic; the tag keeps it apart from tokens.
        h.update(b"\x00extra:")
        h.update(repr(extra_keys).encode())
    return h.digest()


def block_extra_keys(
    request: Request, block_index: int, block_size: int = 0
) -> tuple[Any, ...] | None:
    """Extra keys of one block: the request's cache_salt and LoRA adapter, on the first
    block only (two adapters never share K/V of the same tokens), and on every block that
    holds image placeholder tokens, each such image's content hash with where the block
    starts inside the image (the same placeholders of two images never share K/V).

    The first block's keys reach every later block through the parent-hash chain.
    """
    images = _image_keys(request, block_index, block_size)
    if block_index != 0:
        return images
    keys: tuple[Any, ...] = ()
    if request.cache_salt is not None:
        keys = ("salt", request.cache_salt)
    if request.lora_request is not None:
        keys = (*keys, *request.lora_request.cache_key)
    if images:
        keys = (*keys, *images)
    return keys or None


def _image_keys(request: Request, block_index: int, block_size: int) -> tuple[Any, ...] | None:
    features = request.mm_features
    if not features or not block_size:
        return None
    start, stop = block_index * block_size, (block_index + 1) * block_size
    keys = tuple(
        ("image", f.identifier, start - f.offset) for f in features if f.overlaps(start, stop)
    )
    return keys or None


def update_block_hashes(request: Request, block_size: int, num_blocks: int) -> list[BlockHash]:
    """Extend request.block_hashes to cover its first num_blocks full blocks; return it."""
    hashes = request.block_hashes
    start = len(hashes)
    if start >= num_blocks:
        return hashes
    tokens = request.all_token_ids
    assert num_blocks * block_size <= len(tokens), "only full blocks are hashed"
    parent = hashes[-1] if hashes else None
    for i in range(start, num_blocks):
        parent = hash_block_tokens(
            parent,
            tokens[i * block_size : (i + 1) * block_size],
            block_extra_keys(request, i, block_size),
        )
        hashes.append(parent)
    return hashes
