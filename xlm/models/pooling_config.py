"""Whether a checkpoint is a pooler, and how it pools, from its own files.

A pooling model embeds, or classifies (`convert="classify"`, vLLM's `--convert
classify`: a `*ForSequenceClassification` checkpoint, or a causal LM whose checkpoint
carries a `score.weight`; xlm.models.classifier). A model runs as a pooler
(`runner="pooling"`) when asked, or under `runner="auto"` when its checkpoint says so: a
sentence-transformers layout (`modules.json` naming a Pooling module) or an architecture
that has no language-model head (`Qwen3Model`, `LlamaModel`,
`*ForSequenceClassification`...). Its default pooling comes from `1_Pooling/config.json`
(last token, mean or CLS) and whether `modules.json` lists a Normalize module; without
them decoder embedders pool the last token, normalized. A sentence-transformers module
xlm does not apply (a `Dense` projection after pooling, ...) is refused rather than
served without it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from xlm.models.registry import base_model_lm
from xlm.pooling_params import PoolingParams, PoolingType

RUNNERS = ("auto", "generate", "pooling")
# vLLM's --convert: what a pooling runner makes of the model (auto: what it is).
CONVERTS = ("auto", "none", "embed", "classify")
# Heads that pool; a headless `*Model` pools too (models.registry.base_model_lm).
_POOLING_SUFFIXES = ("ForSequenceClassification", "ForEmbedding")
# sentence-transformers pooling flags -> our types, in the order they are preferred.
_ST_MODES = (
    ("pooling_mode_lasttoken", PoolingType.LAST),
    ("pooling_mode_mean_tokens", PoolingType.MEAN),
    ("pooling_mode_cls_token", PoolingType.CLS),
)
# sentence-transformers modules whose effect the pooler reproduces.
_ST_APPLIED = ("Transformer", "Pooling", "Normalize")


def _read_json(path: str) -> object | None:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def _st_modules(model_dir: str) -> list[dict]:
    modules = _read_json(os.path.join(model_dir, "modules.json"))
    return modules if isinstance(modules, list) else []


def _is_st_pooler(model_dir: str) -> bool:
    return any(str(m.get("type", "")).endswith("Pooling") for m in _st_modules(model_dir))


def resolve_runner(
    runner: str, model_dir: str, architectures: Sequence[str] | None, convert: str = "auto"
) -> str:
    """ "generate" or "pooling": `runner` itself, or under "auto" what the checkpoint says
    (a `convert` to embed or classify asks for the pooling runner, as in vLLM)."""
    if runner not in RUNNERS:
        raise ValueError(f"runner={runner!r} is invalid: allowed {', '.join(RUNNERS)}")
    if runner != "auto":
        return runner
    if convert in ("embed", "classify"):
        return "pooling"
    if os.path.isdir(model_dir) and _is_st_pooler(model_dir):
        return "pooling"
    arch = (architectures or [""])[0]
    if base_model_lm(arch) is not None or arch.endswith(_POOLING_SUFFIXES):
        return "pooling"
    return "generate"


def resolve_convert(convert: str, runner: str, architectures: Sequence[str] | None) -> str:
    """ModelConfig.convert for a resolved runner: "none" when generating; under pooling
    "classify" for a `*ForSequenceClassification` checkpoint or when asked, else "embed"."""
    if convert not in CONVERTS:
        raise ValueError(f"convert={convert!r} is invalid: allowed {', '.join(CONVERTS)}")
    if runner != "pooling":
        if convert in ("embed", "classify"):
            raise ValueError(
                f"convert={convert!r} is invalid with runner={runner!r}: converting a model "
                "to embed or classify needs runner 'pooling' (or 'auto')"
            )
        return "none"
    if convert in ("embed", "classify"):
        return convert
    arch = (architectures or [""])[0]
    return "classify" if arch.endswith("ForSequenceClassification") else "embed"


def default_pooling_params(model_dir: str, convert: str = "embed") -> PoolingParams:
    """The checkpoint's own pooling (sentence-transformers files), else last token + L2;
    a classifier's label scores from the last token (transformers' classifiers read it)."""
    if convert == "classify":
        return PoolingParams(pooling_type=PoolingType.LAST, normalize=False, task="classify")
    pooling_type, normalize = PoolingType.LAST, True
    if os.path.isdir(model_dir) and _is_st_pooler(model_dir):
        _check_st_modules(model_dir)
        pooling_dir = next(
            m.get("path", "") for m in _st_modules(model_dir) if m["type"].endswith("Pooling")
        )
        config = _read_json(os.path.join(model_dir, pooling_dir, "config.json")) or {}
        pooling_type = next((t for key, t in _ST_MODES if config.get(key)), pooling_type)
        normalize = any(
            str(m.get("type", "")).endswith("Normalize") for m in _st_modules(model_dir)
        )
    return PoolingParams(pooling_type=pooling_type, normalize=normalize)


def _check_st_modules(model_dir: str) -> None:
    """Raise for a module in `modules.json` that xlm would skip (its embeddings would differ)."""
    for m in _st_modules(model_dir):
        kind = str(m.get("type", ""))
        if not kind.endswith(_ST_APPLIED):
            raise ValueError(
                f"{model_dir}: modules.json lists {kind} (in {m.get('path') or '.'!r}), a "
                "sentence-transformers module xlm does not apply; serving without it would "
                f"give other embeddings. Supported modules: {', '.join(_ST_APPLIED)}"
            )


def num_labels_of(hf_config: Any) -> int:
    """The classifier's number of labels (transformers' `num_labels`, from id2label)."""
    return int(getattr(hf_config, "num_labels", None) or 1)


def label_names(hf_config: Any) -> list[str]:
    """Each label's name from config.id2label (LABEL_i where it has none)."""
    id2label = getattr(hf_config, "id2label", None) or {}
    return [
        str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}")))
        for i in range(num_labels_of(hf_config))
    ]
