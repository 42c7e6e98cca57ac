"""Pair scoring (xlm.entrypoints.score_utils): vLLM's 1-to-1 / 1-to-N / N-to-N pairing and its
refusals, the model checks, the cross-encoder's pair encoding, and an embedding model's
LLM.score equal to numpy's cosine of LLM.embed's vectors."""

from __future__ import annotations

import numpy as np
import pytest

import xlm
from tests.conftest import build_tokenizer
from xlm.engine.exceptions import RequestValidationError
from xlm.engine.processor import PoolingModel
from xlm.entrypoints import score_utils
from xlm.pooling_params import PoolingParams


def test_pairs_one_to_one_one_to_n_and_n_to_n():
    assert score_utils.score_pairs("q", "d") == [("q", "d")]
    assert score_utils.score_pairs("q", ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert score_utils.score_pairs(["q"], ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert score_utils.score_pairs(["x", "y"], ["a", "b"]) == [("x", "a"), ("y", "b")]


@pytest.mark.parametrize(
    "text_1, text_2, param, match",
    [
        (["x", "y"], ["a", "b", "c"], "text_2", "text_1 has 2 entries and text_2 has 3"),
        (["x", "y"], "a", "text_2", "text_1 has 2 entries and text_2 has 1"),
        ([], ["a"], "text_1", "text_1 must not be empty"),
        ("q", [], "text_2", "text_2 must not be empty"),
        ("q", ["a", 3], "text_2", "text_2 must be a string or a list of strings"),
    ],
)
def test_bad_pairs_name_the_field(text_1, text_2, param, match):
    with pytest.raises(RequestValidationError, match=match) as info:
        score_utils.score_pairs(text_1, text_2)
    assert info.value.param == param


def test_which_models_score():
    cross = PoolingModel(PoolingParams(task="classify"), 64, 256, ("LABEL_0",))
    embedder = PoolingModel(PoolingParams(), 64, 256)
    three = PoolingModel(PoolingParams(task="classify"), 64, 256, ("a", "b", "c"))
    assert score_utils.check_scoring_model(cross) is True
    assert score_utils.check_scoring_model(embedder) is False
    with pytest.raises(RequestValidationError, match="3 labels.*single-label"):
        score_utils.check_scoring_model(three)
    with pytest.raises(RequestValidationError, match="generates text.*does not score"):
        score_utils.check_scoring_model(None)


def test_inputs_a_cross_encoder_pools_one_pair_an_embedder_each_text():
    tokenizer = build_tokenizer()
    pairs = [("w1 w2", "w3"), ("w1 w2", "w4 w5")]
    ids, params = score_utils.score_inputs(tokenizer, pairs, cross_encoder=True)
    assert ids == [tokenizer("w1 w2", "w3")["input_ids"], tokenizer("w1 w2", "w4 w5")["input_ids"]]
    assert params.task == "classify"
    ids, params = score_utils.score_inputs(tokenizer, pairs, cross_encoder=False)
    assert params is None
    assert ids == [tokenizer.encode(t) for t in ("w1 w2", "w1 w2", "w3", "w4 w5")]
    assert score_utils.score_token_ids(ids, False) == [ids[0] + ids[2], ids[1] + ids[3]]
    assert score_utils.pair_scores([np.array([0.25]), np.array([0.75])], True) == [0.25, 0.75]


def test_cosine_scores_equal_numpy():
    rng = np.random.default_rng(0)
    vectors = list(rng.normal(size=(6, 16)).astype(np.float32))
    scores = score_utils.pair_scores(vectors, cross_encoder=False)
    for i, s in enumerate(scores):
        a, b = vectors[i].astype(np.float64), vectors[3 + i].astype(np.float64)
        assert s == pytest.approx(a @ b / np.linalg.norm(a) / np.linalg.norm(b), abs=1e-9)


def test_classification_names_the_likeliest_label():
    out = score_utils.classification(np.array([0.1, 0.7, 0.2]), ["a", "b", "c"])
    assert out.label == "b" and out.num_classes == 3
    assert out.probs == pytest.approx([0.1, 0.7, 0.2])


def test_an_embedding_model_scores_the_cosine_of_llm_embed(tiny_checkpoint):
    llm = xlm.LLM(
        model=tiny_checkpoint("qwen3"),
        runner="pooling",
        max_model_len=64,
        max_num_batched_tokens=256,
        token_buckets=[32, 256],
        kv_cache_memory=0.02,
        dtype="float32",
    )
    tokenizer = llm.get_tokenizer()
    query, docs = "w1 w2 w3", ["w4 w5", "w6 w7 w8", "w1 w2 w3"]
    outs = llm.score(query, docs, use_tqdm=False)
    vectors = [
        o.outputs.data.astype(np.float64)
        for o in llm.embed([query, *docs], PoolingParams(normalize=False), use_tqdm=False)
    ]
    for i, out in enumerate(outs):
        a, b = vectors[0], vectors[1 + i]
        want = a @ b / np.linalg.norm(a) / np.linalg.norm(b)
        assert out.outputs.score == pytest.approx(want, abs=1e-5)
        assert out.prompt_token_ids == tokenizer.encode(query) + tokenizer.encode(docs[i])
    assert outs[2].outputs.score == pytest.approx(1.0, abs=1e-5)  # the query itself
    with pytest.raises(RequestValidationError, match="embedding model.*no classification head"):
        llm.classify(["w1"], use_tqdm=False)
