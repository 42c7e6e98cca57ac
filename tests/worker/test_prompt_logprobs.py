"""Prompt logprobs through the engine equal log-softmax of transformers' logits."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import xlm


@pytest.fixture(scope="module")
def llama_dir(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def llm(llama_dir, tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("XLM_COMPILATION_CACHE_DIR", str(tmp_path_factory.mktemp("cc")))
    # A small step budget forces the prompt through several chunks.
    return xlm.LLM(
        model=llama_dir,
        max_model_len=128,
        max_num_batched_tokens=16,
        token_buckets=[4, 16],
        max_num_seqs=4,
        kv_cache_memory=0.01,
    )


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_prompt_logprobs_match_transformers_across_chunks(llm, llama_dir):
    rng = np.random.default_rng(0)
    prompt = rng.integers(5, 200, size=37).tolist()
    params = xlm.SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    # Twice: the second run would hit the prefix cache, which prompt logprobs must bypass.
    for _ in range(2):
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        ref = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
        with torch.no_grad():
            logits = ref(torch.tensor([prompt])).logits[0].float()
        ref_lp = torch.log_softmax(logits, -1).numpy()
        assert out.prompt_logprobs[0] is None
        assert len(out.prompt_logprobs) == len(prompt)
        for pos in range(1, len(prompt)):
            entry = out.prompt_logprobs[pos]
            token = prompt[pos]
            assert entry[token].logprob == pytest.approx(ref_lp[pos - 1, token], abs=1e-4)
            assert entry[token].rank == 1 + int((ref_lp[pos - 1] > ref_lp[pos - 1, token]).sum())
            top3 = set(np.argsort(-ref_lp[pos - 1])[:3].tolist())
            assert {t for t, lp in entry.items() if lp.rank <= 3} == top3
        assert out.num_cached_tokens == 0
