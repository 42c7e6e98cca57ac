"""Multi-LoRA engines: each adapter's greedy output equals transformers + peft on the same
adapter; a mixed, preempting, prefix-cached batch of more adapters than slots equals each
request alone; adapters unload safely while their requests run; no step recompiles."""

from __future__ import annotations

import numpy as np
import pytest

import xlm
from tests.conftest import VOCAB_SIZE
from tests.engine.reference import SMALL_ENGINE, hf_greedy, load_hf, small_engine
from tests.lora.adapters import TARGETS, write_adapter

NEW_TOKENS = 16
# SMALL_ENGINE's shapes (one token bucket, 8 request rows: half of TINY_ENGINE's programs;
# a batch of 32 still preempts) with two adapter slots.
LORA_ENGINE = dict(SMALL_ENGINE, enable_lora=True, max_loras=2, max_lora_rank=8)


def greedy(n: int = NEW_TOKENS) -> xlm.SamplingParams:
    return xlm.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1)


def chosen_logprobs(out) -> list[float]:
    c = out.outputs[0]
    return [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def compilations(llm) -> int:
    return llm.llm_engine.num_compilations


def slots_of(llm):
    return llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.lora


# ---- against transformers + peft, per family ---------------------------------------------


@pytest.mark.parametrize("arch", sorted(TARGETS))
def test_each_adapter_equals_transformers_peft(arch, tiny_checkpoint, tmp_path):
    base = tiny_checkpoint(arch)
    # Two adapters: rank 4 with rsLoRA scaling, and the full rank 8.
    refs = [
        write_adapter(base, str(tmp_path / "a1"), arch, seed=1, r=4, use_rslora=True),
        write_adapter(base, str(tmp_path / "a2"), arch, seed=2, r=8),
    ]
    loras = [xlm.LoRARequest(f"a{i}", i, str(tmp_path / f"a{i}")) for i in (1, 2)]
    rng = np.random.default_rng(1)
    prompts = [rng.integers(6, VOCAB_SIZE, size=n).tolist() for n in (5, 17, 70)]
    llm = xlm.LLM(model=base, **LORA_ENGINE)
    compiled = compilations(llm)
    hf_base = load_hf(base)
    for lora, ref_model in zip(loras, refs):
        outs = llm.generate(prompts, greedy(), use_tqdm=False, lora_request=lora)
        for prompt, out in zip(prompts, outs):
            ref = hf_greedy(ref_model, prompt, NEW_TOKENS)
            assert out.outputs[0].token_ids == ref.token_ids, f"{arch} {lora.lora_name}"
            want = log_softmax(ref.logits)[np.arange(NEW_TOKENS), ref.token_ids]
            np.testing.assert_allclose(chosen_logprobs(out), want, atol=2e-3)
            # The reference itself moved: an engine ignoring the adapter would fail above.
            base_ref = hf_greedy(hf_base, prompt, NEW_TOKENS)
            assert np.abs(ref.logits[0] - base_ref.logits[0]).max() > 0.1
    # The base model beside them is the base model.
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf_base, prompt, NEW_TOKENS).token_ids
    assert compilations(llm) == compiled  # adapters written into slots: no recompiles


# ---- a mixed batch ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def mixed(tiny_checkpoint, tmp_path_factory):
    """An engine with 2 slots, 3 registered adapters, and their LoRARequests."""
    base = tiny_checkpoint("llama")
    root = tmp_path_factory.mktemp("mixed_adapters")
    loras = []
    for i, r in ((1, 8), (2, 4), (3, 6)):
        write_adapter(base, str(root / f"a{i}"), "llama", seed=10 + i, r=r)
        loras.append(xlm.LoRARequest(f"a{i}", i, str(root / f"a{i}")))
    # Host cache of 2 < 3 adapters: one is read again from its directory when needed.
    llm = xlm.LLM(model=base, **LORA_ENGINE, max_cpu_loras=2)
    return llm, loras


def test_mixed_batch_of_more_adapters_than_slots_equals_each_alone(mixed):
    llm, loras = mixed
    rng = np.random.default_rng(3)
    # 8 prompts sharing a 20-token prefix (prefix-cache hits), each under every adapter
    # and the base model: 32 requests, same tokens under 4 models.
    prefix = rng.integers(6, VOCAB_SIZE, size=20).tolist()
    prompts = [prefix + rng.integers(6, VOCAB_SIZE, size=n).tolist() for n in range(3, 11)]
    choices = [None, *loras]
    batch = [(p, choices[(i + j) % 4]) for i, p in enumerate(prompts) for j in range(4)]
    alone = {}
    for prompt, lora in batch:
        (out,) = llm.generate([prompt], greedy(24), use_tqdm=False, lora_request=lora)
        alone[(tuple(prompt), lora)] = out.outputs[0].token_ids
    core = llm.llm_engine.engine_core.engine_core
    before = core.scheduler.num_preemptions
    writes = slots_of(llm).num_slot_writes
    compiled = compilations(llm)
    outs = llm.generate(
        [p for p, _ in batch], greedy(24), use_tqdm=False, lora_request=[lo for _, lo in batch]
    )
    assert core.scheduler.num_preemptions > before, "the KV pool was meant to preempt"
    assert slots_of(llm).num_slot_writes > writes  # 3 adapters through 2 slots
    assert compilations(llm) == compiled
    for (prompt, lora), out in zip(batch, outs):
        assert out.outputs[0].token_ids == alone[(tuple(prompt), lora)], lora
    # Same tokens under different adapters gave different outputs (nothing shared).
    for prompt in prompts:
        assert len({tuple(alone[(tuple(prompt), lo)]) for lo in choices}) > 1


def test_prefix_cache_is_keyed_by_adapter(mixed):
    llm, loras = mixed
    prompt = np.random.default_rng(4).integers(6, VOCAB_SIZE, size=40).tolist()
    (first,) = llm.generate([prompt], greedy(4), use_tqdm=False, lora_request=loras[0])
    (again,) = llm.generate([prompt], greedy(4), use_tqdm=False, lora_request=loras[0])
    (other,) = llm.generate([prompt], greedy(4), use_tqdm=False, lora_request=loras[1])
    (base,) = llm.generate([prompt], greedy(4), use_tqdm=False)
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == 32  # two full blocks of its own adapter
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_unload_while_running_finishes_its_requests(mixed):
    llm, loras = mixed
    engine = llm.llm_engine
    lora = loras[2]
    prompts = [
        np.random.default_rng(5 + i).integers(6, VOCAB_SIZE, size=9).tolist() for i in (0, 1)
    ]
    want = [
        o.outputs[0].token_ids
        for o in llm.generate(prompts, greedy(20), use_tqdm=False, lora_request=lora)
    ]
    params = greedy(20)
    params.output_kind = xlm.sampling_params.RequestOutputKind.FINAL_ONLY
    for i, prompt in enumerate(prompts):
        engine.add_request(f"unload-{i}", prompt, params, lora_request=lora)
    finished = {}
    for _ in range(3):
        for out in engine.step():
            finished[out.request_id] = out
    assert llm.remove_lora(lora.lora_int_id)
    assert lora.lora_int_id not in llm.list_loras()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert [finished[f"unload-{i}"].outputs[0].token_ids for i in (0, 1)] == want
    assert not llm.remove_lora(lora.lora_int_id)  # already unloaded
    llm.generate([prompts[0]], greedy(2), use_tqdm=False)  # a step tells the worker they ended
    assert lora.lora_int_id not in slots_of(llm).requests  # forgotten once they ended
    # Named again, it is read again from its directory.
    (out,) = llm.generate([prompts[0]], greedy(20), use_tqdm=False, lora_request=lora)
    assert out.outputs[0].token_ids == want[0]


def test_bad_adapters_fail_alone(mixed, tmp_path):
    llm, loras = mixed
    prompt = [7, 8, 9, 10]
    (want,) = llm.generate([prompt], greedy(8), use_tqdm=False, lora_request=loras[0])
    bad = xlm.LoRARequest("bad", 99, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="is not a directory"):
        llm.generate([prompt], greedy(8), use_tqdm=False, lora_request=bad)
    with pytest.raises(ValueError, match="is not a directory"):
        llm.add_lora(bad)
    assert 99 not in llm.list_loras()
    assert not llm.llm_engine.has_unfinished_requests()
    (out,) = llm.generate([prompt], greedy(8), use_tqdm=False, lora_request=loras[0])
    assert out.outputs[0].token_ids == want.outputs[0].token_ids
    with pytest.raises(ValueError, match="lora_request has 2 entries but there are 1 prompts"):
        llm.generate([prompt], greedy(8), use_tqdm=False, lora_request=[loras[0], None])


def test_lora_request_without_enable_lora_is_refused(tiny_checkpoint, tmp_path):
    llm = small_engine(tiny_checkpoint("llama"))
    lora = xlm.LoRARequest("a", 1, str(tmp_path))
    with pytest.raises(ValueError, match="LoRA is off: start the engine with enable_lora=True"):
        llm.generate([[5, 6, 7]], greedy(2), use_tqdm=False, lora_request=lora)
    (out,) = llm.generate([[5, 6, 7]], greedy(2), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_loras=0), "LoRAConfig.max_loras=0 is invalid"),
        (dict(max_lora_rank=1024), "LoRAConfig.max_lora_rank=1024 is invalid: allowed 1 to 512"),
        (dict(max_loras=4, max_cpu_loras=2), "max_cpu_loras=2 is invalid: allowed >= max_loras"),
    ],
)
def test_bad_lora_options_name_the_parameter(kwargs, message):
    from xlm.config import LoRAConfig

    with pytest.raises(ValueError, match=message):
        LoRAConfig(**kwargs)


def test_lora_request_fields_are_checked():
    with pytest.raises(ValueError, match="lora_int_id=0 is invalid"):
        xlm.LoRARequest("a", 0, "/x")
    with pytest.raises(ValueError, match="lora_name='' is invalid"):
        xlm.LoRARequest("", 1, "/x")


def test_adapters_with_speculative_decoding_equal_without(mixed, tiny_checkpoint):
    """Proposals (prompt lookup) are verified by the model with each request's adapter:
    greedy outputs equal the engine without speculation."""
    llm, loras = mixed
    spec = xlm.LLM(
        model=tiny_checkpoint("llama"),
        **LORA_ENGINE,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False},
    )
    rng = np.random.default_rng(6)
    # Repetitive prompts, so that prompt lookup finds proposals.
    prompts = [(rng.integers(6, VOCAB_SIZE, size=6).tolist() * 4) for _ in range(6)]
    chosen = [None, *loras[:2]] * 2
    want = llm.generate(prompts, greedy(20), use_tqdm=False, lora_request=chosen)
    got = spec.generate(prompts, greedy(20), use_tqdm=False, lora_request=chosen)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert spec.get_stats().spec_num_draft_tokens > 0


SLOT_ORDER_SCRIPT = """
import sys, xlm
from tests.lora.adapters import write_adapter
base, root = sys.argv[1], sys.argv[2]
llm = xlm.LLM(model=base, enable_lora=True, max_loras=3, max_lora_rank=4, startup_programs="used",
              max_model_len=64, num_gpu_blocks_override=8, enable_compilation_cache=False)
slots = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.lora
loras = [xlm.LoRARequest(f"adapter-{i}", i, f"{root}/a{i}") for i in (1, 2, 3)]
print(slots.slots_for([loras[2], None, loras[0], loras[1], loras[2]]).tolist())
"""


def test_slots_follow_the_step_order_in_every_process(tiny_checkpoint, tmp_path):
    """Processes with different string hashes (separate hosts) fill the same slots."""
    import os
    import subprocess
    import sys

    base = tiny_checkpoint("llama")
    for i in (1, 2, 3):
        write_adapter(base, str(tmp_path / f"a{i}"), "llama", seed=i, r=4)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    seen = set()
    for seed in ("1", "2", "3", "4"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=root)
        proc = subprocess.run(
            [sys.executable, "-c", SLOT_ORDER_SCRIPT, base, str(tmp_path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        seen.add(proc.stdout.strip().splitlines()[-1])
    assert seen == {"[1, 0, 2, 3, 1]"}
