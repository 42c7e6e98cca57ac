"""Sleep mode and weight updates through xlm.LLM: outputs unchanged across sleep/wake_up,
the device memory freed, nothing compiled; update_weights gives a fresh engine's outputs."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import xlm
from tests.conftest import VOCAB_SIZE, write_tiny_checkpoint
from tests.engine.reference import TINY_ENGINE
from xlm.engine.exceptions import EngineBusyError

ARCH = "llama"
NEW_TOKENS = 12


def greedy() -> xlm.SamplingParams:
    return xlm.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def token_ids(llm: xlm.LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)]


def live_bytes() -> int:
    """Bytes of every live jax array on this process's devices."""
    return sum(a.nbytes for a in jax.live_arrays())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """Two random checkpoints of one shape ("a", "b") and one of another shape ("wide")."""
    root = tmp_path_factory.mktemp("sleep_mode")
    return {
        "a": write_tiny_checkpoint(ARCH, str(root / "a"), seed=0),
        "b": write_tiny_checkpoint(ARCH, str(root / "b"), seed=1),
        "wide": write_tiny_checkpoint(ARCH, str(root / "wide"), seed=2, intermediate_size=192),
    }


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(6, VOCAB_SIZE, size=n).tolist() for n in (5, 21, 40)]


@pytest.fixture(scope="module")
def llm(checkpoints) -> xlm.LLM:
    return xlm.LLM(model=checkpoints["a"], enable_sleep_mode=True, **TINY_ENGINE)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_wake_up_keeps_outputs_frees_memory_compiles_nothing(llm, prompts, level):
    before = token_ids(llm, prompts)
    engine = llm.llm_engine
    compiled = engine.num_compilations
    held = engine.device_bytes()
    assert held["weights"] > 0 and held["kv_cache"] > 0
    live = live_bytes()

    freed = llm.sleep(level)

    assert llm.is_sleeping()
    assert freed == held  # every weight and KV cache byte it held
    assert engine.device_bytes() == {"weights": 0, "kv_cache": 0}
    # The process's live device arrays shrank by what it says it freed.
    assert live - live_bytes() >= held["weights"] + held["kv_cache"]
    with pytest.raises(ValueError, match="asleep"):
        llm.generate(prompts[:1], greedy(), use_tqdm=False)

    llm.wake_up()

    assert not llm.is_sleeping()
    assert engine.device_bytes() == held
    assert token_ids(llm, prompts) == before
    assert engine.num_compilations == compiled


def test_sleep_refuses_bad_level_and_wake_up_when_awake_is_a_no_op(llm, prompts):
    before = token_ids(llm, prompts[:1])
    for level in (0, 3, True, "1"):
        with pytest.raises(ValueError, match="level="):
            llm.sleep(level)
    assert not llm.is_sleeping()
    llm.wake_up()
    assert not llm.is_sleeping()
    assert token_ids(llm, prompts[:1]) == before


@pytest.fixture(scope="module")
def fresh_b(checkpoints) -> xlm.LLM:
    """An engine started from checkpoint "b" (sleep mode off)."""
    return xlm.LLM(model=checkpoints["b"], **TINY_ENGINE)


def test_sleep_needs_sleep_mode(fresh_b):
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        fresh_b.sleep(1)
    assert not fresh_b.is_sleeping()


def test_update_weights_gives_the_new_checkpoints_outputs(llm, checkpoints, prompts, fresh_b):
    original = token_ids(llm, prompts)
    compiled = llm.llm_engine.num_compilations
    expected = token_ids(fresh_b, prompts)
    assert expected != original  # the two checkpoints answer differently

    llm.update_weights(checkpoints["b"])
    assert token_ids(llm, prompts) == expected
    assert llm.llm_engine.num_compilations == compiled

    # Level 2 reads the weights again from the checkpoint now in use, not the first one.
    llm.sleep(2)
    llm.wake_up()
    assert token_ids(llm, prompts) == expected

    llm.update_weights(checkpoints["a"])
    assert token_ids(llm, prompts) == original


def test_update_weights_mismatch_names_the_tensor_and_changes_nothing(llm, checkpoints, prompts):
    before = token_ids(llm, prompts)
    named = r"tensor \S*mlp\S* is \(\d+, \d+\) float32 in .*wide.*nothing was changed"
    with pytest.raises(ValueError, match=named):
        llm.update_weights(checkpoints["wide"])
    with pytest.raises(ValueError, match="does not exist"):
        llm.update_weights(checkpoints["a"] + "-missing")
    assert token_ids(llm, prompts) == before


def test_sleep_and_update_weights_refuse_a_busy_engine(llm, checkpoints, prompts):
    before = token_ids(llm, prompts[:1])
    engine = llm.llm_engine
    engine.add_request("busy", prompts[0], greedy())
    with pytest.raises(EngineBusyError, match="1 requests are unfinished"):
        llm.sleep(1)
    with pytest.raises(EngineBusyError, match="unfinished"):
        llm.update_weights(checkpoints["b"])
    engine.abort_request(["busy"])
    assert not llm.is_sleeping()
    assert token_ids(llm, prompts[:1]) == before  # the old weights still serve

    llm.sleep(1)
    with pytest.raises(ValueError, match="asleep"):
        llm.update_weights(checkpoints["b"])
    llm.wake_up()
    assert token_ids(llm, prompts[:1]) == before
