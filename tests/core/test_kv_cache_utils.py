"""Block hashes are stable across processes and separate salts and parents."""

import subprocess
import sys
from pathlib import Path

from tests.core.sim import make_request
from xlm.core.kv_cache_utils import NONE_HASH, hash_block_tokens, update_block_hashes

_SNIPPET = (
    "from xlm.core.kv_cache_utils import hash_block_tokens as h;"
    "print(h(h(None, [1, 2, 3, 4], ('salt', 's')), [5, 6, 7, 8]).hex())"
)


def test_hash_is_stable_across_processes():
    here = hash_block_tokens(hash_block_tokens(None, [1, 2, 3, 4], ("salt", "s")), [5, 6, 7, 8])
    outs = set()
    for seed in ("1", "2"):
        env = {"PYTHONHASHSEED": seed, "PATH": ""}
        out = subprocess.run(
            [sys.executable, "-c", _SNIPPET],
            capture_output=True,
            text=True,
            env=env,
            check=True,
            cwd=Path(__file__).resolve().parents[2],
        )
        outs.add(out.stdout.strip())
    assert outs == {here.hex()}
    assert len(here) == 32


def test_hash_depends_on_parent_tokens_and_extra_keys():
    base = hash_block_tokens(None, [1, 2, 3, 4])
    assert base == hash_block_tokens(NONE_HASH, [1, 2, 3, 4])
    assert base != hash_block_tokens(None, [1, 2, 3, 5])
    assert base != hash_block_tokens(base, [1, 2, 3, 4])
    assert base != hash_block_tokens(None, [1, 2, 3, 4], ("salt", "a"))
    assert hash_block_tokens(None, [1], ("salt", "a")) != hash_block_tokens(
        None, [1], ("salt", "b")
    )
    # Large token ids serialize without collision with small ones.
    assert hash_block_tokens(None, [2**40]) != hash_block_tokens(None, [0])


def test_update_block_hashes_salts_first_block_and_chains():
    a = make_request("a", list(range(10)), cache_salt="x")
    b = make_request("b", list(range(10)))
    ha = update_block_hashes(a, 4, 2)
    hb = update_block_hashes(b, 4, 2)
    assert len(ha) == 2 and ha is a.block_hashes
    assert ha[0] != hb[0] and ha[1] != hb[1]
    assert hb[1] == hash_block_tokens(hb[0], [4, 5, 6, 7])
    assert update_block_hashes(b, 4, 1) == hb  # never shrinks or recomputes


def _feature(identifier: str, offset: int, length: int):
    import numpy as np

    from xlm.multimodal.inputs import MultiModalFeature

    return MultiModalFeature("image", identifier, offset, length, np.zeros((3, 1, 1), np.float32))


def test_blocks_holding_image_placeholders_hash_the_image():
    tokens = [7] * 12  # the same placeholder tokens, blocks of 4: the image spans 2..9
    a = make_request("a", tokens)
    b = make_request("b", tokens)
    c = make_request("c", tokens)
    a.mm_features = [_feature("cat", 2, 8)]
    b.mm_features = [_feature("dog", 2, 8)]
    c.mm_features = [_feature("cat", 2, 8)]
    ha, hb, hc = (update_block_hashes(r, 4, 3) for r in (a, b, c))
    assert ha == hc  # one image: the same blocks, shareable
    assert all(x != y for x, y in zip(ha, hb, strict=True))  # another image: none shared
    # The block's place inside the image is keyed: equal tokens, shifted image, other hash.
    d = make_request("d", tokens)
    d.mm_features = [_feature("cat", 3, 8)]
    assert update_block_hashes(d, 4, 1)[0] != ha[0]
    # A block past the image hashes its tokens only (its parent carries the image).
    e = make_request("e", tokens)
    e.mm_features = [_feature("cat", 0, 4)]
    he = update_block_hashes(e, 4, 2)
    assert he[1] == hash_block_tokens(he[0], [7] * 4)
