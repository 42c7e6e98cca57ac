"""The pooling runner's programs are the model and the pooler only, keyed apart from the
generate runner's: both runners over one program cache each load their own, and the
pooled vector equals transformers' last hidden state pooled the same way."""

from __future__ import annotations

import numpy as np

import xlm
from tests.engine.test_llm_embed import ENGINE, reference
from xlm.pooling_params import PoolingParams


def test_generate_and_pooling_runners_share_no_compiled_program(
    tiny_checkpoint, tmp_path, monkeypatch
):
    """One model, one program cache, both runners: each loads only its own programs (a
    pooling engine once loaded the generate programs from disk and died on their outputs)."""
    monkeypatch.setenv("XLM_COMPILATION_CACHE_DIR", str(tmp_path / "cc"))
    model_dir = tiny_checkpoint("llama")
    options = {k: v for k, v in ENGINE.items() if k != "runner"}
    prompt = [5, 9, 2, 7]
    for _ in range(2):  # the second round loads both runners' programs from the cache
        generator = xlm.LLM(model=model_dir, runner="generate", **options)
        [out] = generator.generate(
            [prompt], xlm.SamplingParams(max_tokens=3, temperature=0), use_tqdm=False
        )
        assert len(out.outputs[0].token_ids) == 3
        [vec] = xlm.LLM(model=model_dir, **ENGINE).embed([prompt], use_tqdm=False)
        np.testing.assert_allclose(
            vec.outputs.data, reference(model_dir, prompt, PoolingParams()), rtol=1e-4, atol=1e-4
        )
