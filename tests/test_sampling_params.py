"""SamplingParams validation, generation-config defaults, serialization."""

import msgpack
import pytest

from xlm.outputs import CompletionOutput
from xlm.sampling_params import RequestOutputKind, SamplingParams, SamplingType


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"n": 0}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.1}, "min_p"),
        ({"seed": 1.5}, "seed"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"logit_bias": {i: 1.0 for i in range(2000)}}, "logit_bias"),
        ({"bad_words": [""]}, "bad_words"),
        ({"output_kind": 7}, "output_kind"),
    ],
)
def test_invalid_values_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{name}.*allowed"):
        SamplingParams(**kwargs)


def test_defaults_and_normalization():
    p = SamplingParams(stop="###", stop_token_ids=[7], logit_bias={"3": 500, 4: -0.5})
    assert p.stop == ["###"] and p.max_tokens == 16 and p.n == 1
    assert p.logit_bias == {3: 100.0, 4: -0.5}  # clamped like OpenAI
    assert 7 in p.all_stop_token_ids
    assert p.output_kind is RequestOutputKind.CUMULATIVE
    assert SamplingParams(temperature=0).sampling_type is SamplingType.GREEDY
    assert SamplingParams(temperature=1e-6).sampling_type is SamplingType.GREEDY
    assert SamplingParams().sampling_type is SamplingType.RANDOM
    assert SamplingParams(seed=3).sampling_type is SamplingType.RANDOM_SEED


def test_generation_config_fills_only_unset_fields():
    gen = {
        "temperature": 0.2,
        "top_p": 0.9,
        "top_k": 50,
        "max_new_tokens": 99,
        "eos_token_id": [5, 6],
    }
    p = SamplingParams(temperature=0.7)
    p.update_from_generation_config(gen, eos_token_ids=2)
    assert p.temperature == 0.7 and p.top_p == 0.9 and p.top_k == 50 and p.max_tokens == 99
    assert p.all_stop_token_ids == {2, 5, 6}
    q = SamplingParams(1, 0.3, ignore_eos=True)  # positional args count as explicit too
    q.update_from_generation_config(gen, eos_token_ids=2)
    assert q.temperature == 0.3 and not q.all_stop_token_ids
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams().update_from_generation_config({"top_p": 3.0})


def test_verify_vocab_names_the_id():
    SamplingParams(stop_token_ids=[9], allowed_token_ids=[0, 9]).verify_vocab(10)
    for kwargs in (
        {"stop_token_ids": [10]},
        {"logit_bias": {12: 1}},
        {"allowed_token_ids": [1, 10]},
    ):
        with pytest.raises(ValueError, match=r"token id 1[02].*\[0, 10\)"):
            SamplingParams(**kwargs).verify_vocab(10)


def test_clone_and_msgpack_roundtrip():
    p = SamplingParams(
        n=2,
        temperature=0.5,
        seed=2**40,
        stop=["a", "b"],
        logit_bias={3: 1.5},
        bad_words=["x"],
        output_kind=RequestOutputKind.DELTA,
        allowed_token_ids=[1, 2],
    )
    p.all_stop_token_ids.add(0)
    p._bad_words_token_ids = [[4, 5]]
    q = p.clone()
    q.all_stop_token_ids.add(99)
    assert 99 not in p.all_stop_token_ids
    r = SamplingParams.from_dict(msgpack.unpackb(msgpack.packb(p.to_dict())))
    assert r == p
    assert r._explicit_fields == p._explicit_fields and r.bad_words_token_ids == [[4, 5]]
    assert r.output_kind is RequestOutputKind.DELTA


class _SpaceTokenizer:
    vocab = {"bad": 1, " bad": 2, "wo": 3, "rd": 4, " wo": 5}

    def encode(self, text, add_special_tokens=False):
        return {"bad": [1], " bad": [2], "word": [3, 4], " word": [5, 4]}[text]


def test_bad_words_tokenized_with_and_without_space():
    p = SamplingParams(bad_words=["bad", " word"])
    p.update_from_tokenizer(_SpaceTokenizer())
    assert p.bad_words_token_ids == [[1], [2], [3, 4], [5, 4]]


def test_completion_output_finished():
    c = CompletionOutput(0, "", [], None, None)
    assert not c.finished()
    c.finish_reason = "stop"
    assert c.finished()


def test_init_is_defined_in_the_class_and_tracks_explicit_fields():
    # A normal class definition: no __init__ swapped in after the class was made.
    assert "__init__" in vars(SamplingParams)
    assert SamplingParams.__init__.__qualname__ == "SamplingParams.__init__"
    p = SamplingParams(2, temperature=1.0)
    assert p._explicit_fields == frozenset({"n", "temperature"}) and p.n == 2
    assert SamplingParams()._explicit_fields == frozenset()
    assert SamplingParams().stop == [] and SamplingParams().all_stop_token_ids == set()
    with pytest.raises(TypeError, match="multiple values"):
        SamplingParams(1, n=2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'temprature'"):
        SamplingParams(temprature=0.5)
