"""Processor: tokenization, validation errors, defaults, msgpack round trip."""

import msgpack
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from xlm.engine.processor import EngineCoreRequest, Processor
from xlm.sampling_params import SamplingParams

WORDS = ["<unk>", "<s>", "</s>", "hello", "world", "bad", "word", "the"]


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.fixture
def processor(tokenizer):
    gen = {"temperature": 0.6, "top_p": 0.95, "eos_token_id": [2, 7]}
    return Processor(tokenizer, max_model_len=10, generation_config=gen, max_logprobs=5)


@pytest.mark.parametrize(
    "prompt", ["hello world", [3, 4], {"prompt": "hello world"}, {"prompt_token_ids": [3, 4]}]
)
def test_prompt_forms(processor, prompt):
    req = processor.process_inputs("r", prompt, SamplingParams(max_tokens=None), arrival_time=1.0)
    assert req.prompt_token_ids == [3, 4]
    assert req.prompt == ("hello world" if "hello" in str(prompt) else None)
    p = req.sampling_params
    assert p.max_tokens == 8  # max_model_len - prompt length
    assert (p.temperature, p.top_p) == (0.6, 0.95)  # generation_config defaults
    assert p.all_stop_token_ids == {2, 7} and req.eos_token_id == 2


def test_user_params_are_not_mutated_and_explicit_values_win(processor):
    params = SamplingParams(temperature=0.1, stop_token_ids=[4], bad_words=["bad word"])
    req = processor.process_inputs("r", [3], params)
    assert req.sampling_params.temperature == 0.1 and params.all_stop_token_ids == {4}
    assert req.sampling_params.all_stop_token_ids == {2, 4, 7}
    assert req.sampling_params.bad_words_token_ids[0] == [5, 6]
    assert req.sampling_params.max_tokens == 9  # default 16 clamped to the context left
    ignore = processor.process_inputs("r", [3], SamplingParams(ignore_eos=True))
    assert ignore.sampling_params.all_stop_token_ids == set()


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ("", SamplingParams(), "prompt is empty"),
        ([], SamplingParams(), "prompt is empty"),
        ([3, 8], SamplingParams(), r"token id 8 .*\[0, 8\)"),
        ([3, -1], SamplingParams(), r"token id -1"),
        ([3] * 10, SamplingParams(), r"length 10\).*maximum model length of 10"),
        ([3] * 4, SamplingParams(max_tokens=7), r"max_tokens.*7.*10 tokens.*4 input.*7 > 10 - 4"),
        ([3], SamplingParams(logprobs=6), r"logprobs=6.*max_logprobs=5"),
        ([3], SamplingParams(prompt_logprobs=9), r"prompt_logprobs=9"),
        ([3], SamplingParams(stop_token_ids=[8]), r"stop_token_ids.*token id 8"),
        ([3], SamplingParams(logit_bias={9: 1}), r"logit_bias.*token id 9"),
        ([3], SamplingParams(allowed_token_ids=[1, 8]), r"allowed_token_ids.*token id 8"),
        ([3] * 8, SamplingParams(min_tokens=3, max_tokens=None), r"min_tokens=3.*max_tokens \(2\)"),
        ({"text": "x"}, SamplingParams(), "expected 'prompt' or 'prompt_token_ids'"),
        (3.5, SamplingParams(), "prompt of type float"),
    ],
)
def test_errors(processor, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        processor.process_inputs("r", prompt, params)


def test_engine_core_request_msgpack_roundtrip(processor):
    req = processor.process_inputs(
        "r",
        "hello the world",
        SamplingParams(seed=5, stop=["x"], logit_bias={3: 2.0}),
        arrival_time=3.0,
        priority=2,
        cache_salt="s",
    )
    back = EngineCoreRequest.from_dict(msgpack.unpackb(msgpack.packb(req.to_dict())))
    assert back == req


def test_a_pooled_input_must_fit_one_step(tokenizer):
    from xlm.engine.exceptions import RequestValidationError
    from xlm.engine.processor import PoolingModel
    from xlm.pooling_params import PoolingParams

    processor = Processor(tokenizer, max_model_len=10)
    processor.pooling = PoolingModel(PoolingParams(pooling_type="mean"), 8, max_tokens=4)
    req = processor.process_inputs("r", [3, 4, 5, 6], None, pooling=True)
    assert req.pooling_params.pooling_type == PoolingParams(pooling_type="mean").pooling_type
    assert req.sampling_params.max_tokens == 1  # a placeholder: nothing is sampled
    with pytest.raises(RequestValidationError, match="5 tokens, more than the 4") as e:
        processor.process_inputs("r", [3, 4, 5, 6, 7], None, pooling=True)
    assert e.value.param == "input" and e.value.code == "context_length_exceeded"
    with pytest.raises(RequestValidationError, match="embedding model"):
        processor.process_inputs("r", [3], SamplingParams())
