"""xlm's logits over a paged, ragged, chunked batch equal transformers' full forward: the
check each model family's test module (tests/models/test_<family>.py) runs on its tiny
random checkpoints."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from tests.conftest import VOCAB_SIZE
from tests.paged_batch import BlockAllocator, StepRequest, build_metadata
from xlm.config import ModelConfig, XlmConfig
from xlm.models.loader import get_model

BLOCK_SIZE = 4
NUM_BLOCKS = 48
MAX_BLOCKS = 8
PAD_TOKENS, PAD_REQS = 32, 4  # every step is padded to one shape: one compile per model

# Per step, request -> tokens it feeds: A and B are full prompts then decode, C is a
# prompt in two chunks (the second starts mid-page) then decode.
PROMPT_LENS = {"A": 11, "B": 7, "C": 13}
SCHEDULE = [
    {"A": 11, "B": 7, "C": 5},
    {"C": 8, "A": 1, "B": 1},
    {"A": 1, "B": 1, "C": 1},
    {"B": 1, "C": 1, "A": 1},
    {"C": 1},
]


def hf_logits(model_dir: str, token_ids: list[int]) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].numpy()


def run_schedule(
    model, token_ids: dict[str, list[int]], seed: int, mesh=None
) -> dict[str, np.ndarray]:
    """Run SCHEDULE through the model; logits of every fed token, per request."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, input_ids, kv_caches, metadata):
        m = nnx.merge(graphdef, state)
        hidden, kv_caches = m(input_ids, kv_caches, metadata)
        return m.compute_logits(hidden), kv_caches

    alloc = BlockAllocator(NUM_BLOCKS, seed)
    tables = {r: alloc.allocate(-(-(n + 3) // BLOCK_SIZE)) for r, n in PROMPT_LENS.items()}
    kv_caches = model.make_kv_caches(NUM_BLOCKS, BLOCK_SIZE, np.float32, mesh=mesh)
    computed = dict.fromkeys(token_ids, 0)
    out = {r: [] for r in token_ids}
    for plan in SCHEDULE:
        reqs, ids = [], []
        for r, n in plan.items():
            reqs.append(StepRequest(tables[r], computed[r], n))
            ids += token_ids[r][computed[r] : computed[r] + n]
        md = build_metadata(
            reqs, BLOCK_SIZE, num_tokens=PAD_TOKENS, num_reqs=PAD_REQS, max_blocks=MAX_BLOCKS
        )
        input_ids = np.zeros(PAD_TOKENS, np.int32)
        input_ids[: len(ids)] = ids
        logits, kv_caches = step(state, input_ids, kv_caches, md)
        logits, start = np.asarray(logits), 0
        for r, n in plan.items():
            out[r].append(logits[start : start + n])
            computed[r] += n
            start += n
    return {r: np.concatenate(v) for r, v in out.items()}


def check_logits_match_transformers(arch: str, tiny_checkpoint) -> None:
    """The SCHEDULE's logits of TINY_CONFIGS[arch] equal transformers' within 1e-4."""
    model_dir = tiny_checkpoint(arch)
    model = get_model(XlmConfig(ModelConfig(model=model_dir, dtype="float32")))
    rng = np.random.default_rng(0)
    fed = {r: sum(plan.get(r, 0) for plan in SCHEDULE) for r in PROMPT_LENS}
    token_ids = {r: rng.integers(0, VOCAB_SIZE, n).tolist() for r, n in fed.items()}
    got = run_schedule(model, token_ids, seed=len(arch))
    for r, ids in token_ids.items():
        ref = hf_logits(model_dir, ids)
        assert got[r].shape == ref.shape, r
        np.testing.assert_allclose(
            got[r], ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max(), err_msg=f"{arch} request {r}"
        )
