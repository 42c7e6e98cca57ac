"""Sequence classifiers (xlm.models.classifier) against transformers on the same weights:
tiny random Llama/Qwen2 `*ForSequenceClassification` checkpoints (one label and three),
and a causal-LM checkpoint carrying a `score.weight` run with `convert="classify"`."""

from __future__ import annotations

import numpy as np
import pytest

import xlm
from tests.conftest import build_tokenizer, write_tiny_checkpoint
from xlm.models.classifier import as_seq_cls_model
from xlm.models.pooling_config import label_names, resolve_convert, resolve_runner
from xlm.models.registry import ModelRegistry, seq_cls_lm

ENGINE = dict(
    max_model_len=64,
    max_num_seqs=8,
    max_num_batched_tokens=256,
    token_buckets=[32, 256],
    kv_cache_memory=0.02,
    dtype="float32",
)
LABELS_3 = {0: "negative", 1: "neutral", 2: "positive"}


def write_tiny_classifier(arch: str, path: str, num_labels: int = 1, seed: int = 0) -> str:
    """A random float32 `*ForSequenceClassification` checkpoint of a tiny `arch` config (the
    conftest's) with `num_labels` labels, plus the test tokenizer."""
    extra = {"id2label": LABELS_3} if num_labels == 3 else {"num_labels": num_labels}
    auto_class = "AutoModelForSequenceClassification"
    return write_tiny_checkpoint(arch, path, seed, auto_class=auto_class, **extra)


def hf_class_logits(model_dir: str, token_ids: list[int]) -> np.ndarray:
    """transformers' classifier logits of one input (batch 1: its last token)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        out = model(torch.tensor([token_ids]))
    return out.logits[0].numpy().astype(np.float64)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    """The test tokenizer alone: transformers would load a Qwen2 directory's tokenizer as a
    Qwen2Tokenizer (from config.json's model_type), which drops the word-level vocabulary."""
    path = str(tmp_path_factory.mktemp("tokenizer"))
    build_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory):
    """(arch, num_labels) -> a cached tiny classifier checkpoint directory."""
    made: dict[tuple[str, int], str] = {}

    def make(arch: str, num_labels: int) -> str:
        key = (arch, num_labels)
        if key not in made:
            path = tmp_path_factory.mktemp(f"{arch}_cls{num_labels}")
            made[key] = write_tiny_classifier(arch, str(path), num_labels)
        return made[key]

    return make


def test_registry_maps_every_family_classifier_to_its_causal_lm():
    assert seq_cls_lm("Qwen2ForSequenceClassification") == "Qwen2ForCausalLM"
    assert seq_cls_lm("GPT2ForSequenceClassification") == "GPT2LMHeadModel"
    assert seq_cls_lm("LlamaForCausalLM") is None
    for arch in ModelRegistry.get_supported_archs():
        if arch.endswith("ForCausalLM"):
            family = arch.removesuffix("ForCausalLM")
            cls = as_seq_cls_model(ModelRegistry.load_model_cls(arch))
            assert cls.__name__ == f"{family}ForSequenceClassification"
            assert issubclass(cls, ModelRegistry.load_model_cls(arch))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_cross_encoder_score_is_sigmoid_of_transformers_logit(arch, classifier_dir, tokenizer_dir):
    model_dir = classifier_dir(arch, 1)
    llm = xlm.LLM(model=model_dir, tokenizer=tokenizer_dir, **ENGINE)
    assert llm.llm_engine.config.model_config.convert == "classify"
    query, docs = "w1 w2 w3", ["w4 w5", "w6 w7 w8 w9", "w10", "w3 w2 w1 w0 w11"]
    outs = llm.score(query, docs, use_tqdm=False)
    tokenizer = build_tokenizer()
    for doc, out in zip(docs, outs):
        ids = tokenizer(query, doc)["input_ids"]
        assert out.prompt_token_ids == ids
        expected = sigmoid(hf_class_logits(model_dir, ids))[0]
        assert abs(out.outputs.score - expected) < 1e-3, (doc, out.outputs.score, expected)
    scores = [o.outputs.score for o in outs]
    assert len(set(np.round(scores, 4))) == len(docs)  # random weights: distinct scores
    [one] = llm.classify([tokenizer(query, docs[0])["input_ids"]], use_tqdm=False)
    assert one.outputs.num_classes == 1
    assert abs(one.outputs.probs[0] - scores[0]) < 1e-6


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_three_label_classify_is_softmax_of_transformers_logits(
    arch, classifier_dir, tokenizer_dir
):
    model_dir = classifier_dir(arch, 3)
    llm = xlm.LLM(model=model_dir, tokenizer=tokenizer_dir, **ENGINE)
    prompts = ["w5 w9 w13", "w20 w21 w22 w23 w24 w25", "w7"]
    outs = llm.classify(prompts, use_tqdm=False)
    tokenizer = build_tokenizer()
    for prompt, out in zip(prompts, outs):
        expected = softmax(hf_class_logits(model_dir, tokenizer.encode(prompt)))
        np.testing.assert_allclose(out.outputs.probs, expected, atol=1e-3)
        assert out.outputs.num_classes == 3
        assert out.outputs.label == LABELS_3[int(np.argmax(expected))]
    with pytest.raises(ValueError, match="3 labels.*single-label"):
        llm.score("w1", "w2", use_tqdm=False)
    with pytest.raises(ValueError, match="classifier.*not embeddings"):
        llm.embed(["w1"], use_tqdm=False)


def test_convert_classify_runs_a_causal_lm_checkpoint_with_a_score_head(tmp_path):
    """A causal LM's checkpoint plus a `score.weight` (transformers' classifier on the same
    backbone) under convert="classify" equals that classifier; lm_head is ignored."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    cls_dir = write_tiny_classifier("llama", str(tmp_path / "cls"), num_labels=1, seed=3)
    lm_dir = tmp_path / "lm"
    config = AutoConfig.from_pretrained(cls_dir)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(lm_dir)
    build_tokenizer().save_pretrained(lm_dir)
    tensors = load_file(f"{cls_dir}/model.safetensors")
    tensors["lm_head.weight"] = torch.randn(config.vocab_size, config.hidden_size)
    save_file(tensors, f"{lm_dir}/model.safetensors", metadata={"format": "pt"})

    assert resolve_runner("auto", str(lm_dir), config.architectures) == "generate"
    llm = xlm.LLM(model=str(lm_dir), convert="classify", **ENGINE)
    assert llm.llm_engine.config.model_config.runner == "pooling"
    ids = build_tokenizer()("w3 w4", "w5 w6 w7")["input_ids"]
    [out] = llm.score("w3 w4", "w5 w6 w7", use_tqdm=False)
    expected = sigmoid(hf_class_logits(cls_dir, ids))[0]
    assert abs(out.outputs.score - expected) < 1e-3


def test_convert_resolves_as_vllm_does():
    cls, lm = ["Qwen2ForSequenceClassification"], ["LlamaForCausalLM"]
    assert resolve_runner("auto", "", lm, "classify") == "pooling"
    assert resolve_convert("auto", "pooling", cls) == "classify"
    assert resolve_convert("auto", "pooling", lm) == "embed"
    assert resolve_convert("classify", "pooling", lm) == "classify"
    assert resolve_convert("auto", "generate", lm) == "none"
    with pytest.raises(ValueError, match="convert='classify' is invalid with runner='generate'"):
        resolve_convert("classify", "generate", lm)
    with pytest.raises(ValueError, match="convert='reward' is invalid: allowed auto"):
        resolve_convert("reward", "pooling", lm)


def test_label_names_fall_back_to_transformers_defaults():
    from transformers import LlamaConfig

    assert label_names(LlamaConfig(num_labels=2)) == ["LABEL_0", "LABEL_1"]
    assert label_names(LlamaConfig(id2label=LABELS_3)) == list(LABELS_3.values())
