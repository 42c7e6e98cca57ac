"""Runner choice and default pooling from a checkpoint's files."""

from __future__ import annotations

import json

import pytest

from xlm.models.pooling_config import default_pooling_params, resolve_runner
from xlm.pooling_params import PoolingType


def write_st(path, mode: str, normalize: bool, dense: bool = False) -> str:
    """A sentence-transformers layout in `path`: Transformer, Pooling (`mode`), then a
    Dense projection and a Normalize module when asked."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if dense:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
        )
    if normalize:
        modules.append(
            {
                "idx": len(modules),
                "name": str(len(modules)),
                "path": f"{len(modules)}_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    flags = {f"pooling_mode_{m}": m == mode for m in ("lasttoken", "mean_tokens", "cls_token")}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(flags))
    return str(path)


@pytest.mark.parametrize(
    "arch, runner",
    [
        ("LlamaForCausalLM", "generate"),
        ("Qwen3ForCausalLM", "generate"),
        ("Qwen3Model", "pooling"),
        ("Qwen3ForSequenceClassification", "pooling"),
        ("MistralModel", "pooling"),
        ("GPT2LMHeadModel", "generate"),  # a head, though its name ends in "Model"
        ("GPT2PreTrainedModel", "generate"),
    ],
)
def test_auto_from_architecture(tmp_path, arch, runner):
    assert resolve_runner("auto", str(tmp_path), [arch]) == runner


def test_explicit_runner_wins_and_bad_runner_names_choices(tmp_path):
    assert resolve_runner("pooling", str(tmp_path), ["LlamaForCausalLM"]) == "pooling"
    assert resolve_runner("generate", str(tmp_path), ["Qwen3Model"]) == "generate"
    with pytest.raises(ValueError, match="runner='embed'.*auto, generate, pooling"):
        resolve_runner("embed", str(tmp_path), None)


@pytest.mark.parametrize(
    "mode, normalize, expected",
    [
        ("lasttoken", True, PoolingType.LAST),
        ("mean_tokens", False, PoolingType.MEAN),
        ("cls_token", True, PoolingType.CLS),
    ],
)
def test_sentence_transformers_layout(tmp_path, mode, normalize, expected):
    model_dir = write_st(tmp_path, mode, normalize)
    assert resolve_runner("auto", model_dir, ["Qwen3ForCausalLM"]) == "pooling"
    p = default_pooling_params(model_dir)
    assert (p.pooling_type, p.normalize) == (expected, normalize)


def test_plain_checkpoint_defaults_to_last_token_normalized(tmp_path):
    p = default_pooling_params(str(tmp_path))
    assert (p.pooling_type, p.normalize, p.dimensions) == (PoolingType.LAST, True, None)


def test_a_dense_module_after_pooling_is_refused_not_skipped(tmp_path):
    model_dir = write_st(tmp_path, "mean_tokens", normalize=True, dense=True)
    with pytest.raises(ValueError, match=r"sentence_transformers\.models\.Dense.*'2_Dense'"):
        default_pooling_params(model_dir)
