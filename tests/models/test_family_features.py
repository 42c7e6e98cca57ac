"""Each new family's distinctive feature matters: switched off, xlm stops matching transformers.

tests/models/logits_check.py shows the full models match transformers within 1e-4 on the
mixed chunked/paged schedule; here the same schedule with one feature disabled must
miss transformers' logits by far more than that tolerance, so the match is not an
accident of the feature being inert in the tiny checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from tests.conftest import VOCAB_SIZE
from tests.models.logits_check import PROMPT_LENS, SCHEDULE, hf_logits, run_schedule
from xlm.config import ModelConfig, XlmConfig
from xlm.models.loader import get_model
from xlm.ops import RMSNorm

# A disabled feature must move the logits by 10x the match tolerance of logits_check.
MISMATCH = 1e-3


def _attention_ops(model):
    return model.attention_ops()


def _no_attn_soft_cap(model) -> None:
    for op in _attention_ops(model):
        assert op.logits_soft_cap is not None
        op.logits_soft_cap = None


def _no_final_soft_cap(model) -> None:
    assert model.final_logit_softcapping is not None
    model.final_logit_softcapping = None


def _no_window(model) -> None:
    windowed = [op for op in _attention_ops(model) if op.sliding_window is not None]
    assert windowed, "the tiny config has no windowed layer"
    for op in windowed:
        op.sliding_window = None


def _no_norm_offset(model) -> None:
    from flax import nnx

    norms = [m for _, m in nnx.iter_graph(model) if isinstance(m, RMSNorm)]
    assert norms and all(n.weight_offset == 1.0 for n in norms)
    for n in norms:
        n.weight_offset = 0.0


def _same_rope_base_everywhere(model) -> None:
    ropes = [layer.self_attn.rotary_emb for layer in model.model.layers]
    assert len({r.base for r in ropes}) == 2  # local and global bases differ
    for r in ropes:
        r.base = ropes[-1].base


def _no_longrope(model) -> None:
    for layer in model.model.layers:
        rope = layer.self_attn.rotary_emb
        assert rope.rope_type == "longrope"
        rope.rope_type = "default"


def _top1_experts(model) -> None:
    for layer in model.model.layers:
        assert layer.mlp.top_k == 2
        layer.mlp.top_k = 1


def _no_position_offset(model) -> None:
    decoder = model.model.decoder
    assert decoder.position_offset == 2
    decoder.position_offset = 0


# (architecture, feature) -> how to switch it off on a loaded model.
ABLATIONS: dict[tuple[str, str], Callable] = {
    ("gemma2", "attention soft-cap"): _no_attn_soft_cap,
    ("gemma2", "final logit soft-cap"): _no_final_soft_cap,
    ("gemma2", "sliding window"): _no_window,
    ("gemma2", "(1 + w) norm offset"): _no_norm_offset,
    ("gemma3", "sliding window"): _no_window,
    ("gemma3", "(1 + w) norm offset incl. q/k norms"): _no_norm_offset,
    ("gemma3", "local rope base"): _same_rope_base_everywhere,
    ("phi3", "longrope scaling"): _no_longrope,
    ("mixtral", "top-2 routing"): _top1_experts,
    ("opt", "position offset"): _no_position_offset,
}


@pytest.fixture(scope="module")
def references(tiny_checkpoint):
    """arch -> (checkpoint dir, token ids per request, transformers' logits per request)."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            path = tiny_checkpoint(arch)
            rng = np.random.default_rng(0)
            fed = {r: sum(plan.get(r, 0) for plan in SCHEDULE) for r in PROMPT_LENS}
            ids = {r: rng.integers(0, VOCAB_SIZE, n).tolist() for r, n in fed.items()}
            cache[arch] = path, ids, {r: hf_logits(path, t) for r, t in ids.items()}
        return cache[arch]

    return get


def max_relative_error(arch: str, references, disable=None) -> float:
    path, ids, ref = references(arch)
    model = get_model(XlmConfig(ModelConfig(model=path, dtype="float32")))
    if disable is not None:
        disable(model)
    got = run_schedule(model, ids, seed=1)
    return max(float(np.abs(got[r] - ref[r]).max() / np.abs(ref[r]).max()) for r in ids)


@pytest.mark.parametrize(("arch", "feature"), list(ABLATIONS), ids=lambda v: str(v))
def test_disabling_the_feature_breaks_the_match(arch, feature, references):
    assert max_relative_error(arch, references, ABLATIONS[arch, feature]) > MISMATCH
