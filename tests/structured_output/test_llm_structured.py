"""Structured outputs end to end on the real SmolLM2-135M through xlm.LLM.

One engine for the module (the session's small SmolLM2 engine: a 20-block KV cache, so a
batch of 64 must preempt). Every constrained output is checked against an independent
reference: ``jsonschema`` for schemas, ``re.fullmatch`` for regexes, set membership for
choices.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.engine.reference import num_preemptions
from xlm import SamplingParams, StructuredOutputsParams

jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.slow

NAME = {"type": "string", "minLength": 1, "maxLength": 12}
SCHEMAS = [
    # 1. flat object, required fields, bounded integer
    {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    # 2. enum
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    },
    # 3. array of strings with bounds
    {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3},
    # 4. nested object
    {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {"first": NAME, "last": NAME},
                "required": ["first", "last"],
                "additionalProperties": False,
            }
        },
        "required": ["person"],
        "additionalProperties": False,
    },
    # 5. bounded number and boolean
    {
        "type": "object",
        "properties": {
            "score": {"type": "number", "minimum": 0, "maximum": 10},
            "passed": {"type": "boolean"},
        },
        "required": ["score", "passed"],
        "additionalProperties": False,
    },
    # 6. array of objects
    {
        "type": "array",
        "minItems": 1,
        "maxItems": 2,
        "items": {
            "type": "object",
            "properties": {"item": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["item", "qty"],
            "additionalProperties": False,
        },
    },
    # 7. integer alone, exclusive bounds
    {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20},
    # 8. string pattern
    {
        "type": "object",
        "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["zip"],
        "additionalProperties": False,
    },
    # 9. enum of integers inside an array, plus a nested required object
    {
        "type": "object",
        "properties": {
            "levels": {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 3},
            "meta": {
                "type": "object",
                "properties": {"ok": {"type": "boolean"}},
                "required": ["ok"],
                "additionalProperties": False,
            },
        },
        "required": ["levels", "meta"],
        "additionalProperties": False,
    },
    # 10. anyOf of two shapes
    {
        "anyOf": [
            {
                "type": "object",
                "properties": {"cat": NAME},
                "required": ["cat"],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "properties": {"dog": NAME},
                "required": ["dog"],
                "additionalProperties": False,
            },
        ]
    },
    # 11. string enum alone
    {"enum": ["low", "medium", "high"]},
]
QUESTIONS = [
    "Describe a person as JSON.",
    "What is your favourite color? Answer in JSON.",
    "List some fruits.",
    "Name a famous scientist.",
    "Grade this essay.",
    "Make a shopping list.",
    "Pick a number between 10 and 20.",
    "What is the zip code of the White House?",
    "Give me difficulty levels.",
    "Name a pet.",
    "How hard is chess?",
]
# Short outputs for the 64-request batch (it runs on a deliberately tiny KV cache).
MIXED_SCHEMAS = [SCHEMAS[1], SCHEMAS[6], SCHEMAS[10], SCHEMAS[7]]
REGEXES = [r"[0-9]{4}-[0-9]{2}-[0-9]{2}", r"(yes|no), because [a-z ]{3,20}\.", r"[A-Z][a-z]{2,8}"]
CHOICES = [["positive", "negative", "neutral"], ["Paris", "London", "Berlin"]]


def chat_prompt(tokenizer, question: str) -> dict:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    return {"prompt_token_ids": list(ids)}


def constrained(max_tokens: int, **spec) -> SamplingParams:
    return SamplingParams(
        temperature=0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**spec)
    )


def check_json(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


@pytest.fixture(scope="module")
def llm(smollm2_llm):
    return smollm2_llm


def test_json_schemas_all_parse_and_validate(llm):
    tokenizer = llm.get_tokenizer()
    prompts = [chat_prompt(tokenizer, q) for q in QUESTIONS]
    params = [constrained(120, json=schema) for schema in SCHEMAS]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for schema, out in zip(SCHEMAS, outputs):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (completion.text, completion.finish_reason)
        check_json(completion.text, schema)


def test_json_object_regex_and_choice(llm):
    tokenizer = llm.get_tokenizer()
    prompts = [chat_prompt(tokenizer, "Tell me about the weather.")]
    params = [constrained(60, json_object=True)]
    for pattern in REGEXES:
        prompts.append(chat_prompt(tokenizer, "Answer briefly: is the sky blue?"))
        params.append(constrained(40, regex=pattern))
    for choices in CHOICES:
        prompts.append(chat_prompt(tokenizer, "Pick one."))
        params.append(constrained(10, choice=choices))
    outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert isinstance(json.loads(outputs[0].text), dict)
    for pattern, out in zip(REGEXES, outputs[1:]):
        assert re.fullmatch(pattern, out.text), (pattern, out.text)
        assert out.finish_reason == "stop"
    for choices, out in zip(CHOICES, outputs[1 + len(REGEXES) :]):
        assert out.text in choices and out.finish_reason == "stop"


def test_sampled_constrained_requests_with_n_and_logprobs(llm):
    params = SamplingParams(
        n=3,
        temperature=1.0,
        seed=7,
        max_tokens=40,
        logprobs=2,
        structured_outputs=StructuredOutputsParams(regex=r"[a-z]{2,6}( [a-z]{2,6}){1,3}"),
    )
    (out,) = llm.generate(["Write a few words:"], params, use_tqdm=False)
    assert len(out.outputs) == 3
    for completion in out.outputs:
        assert re.fullmatch(r"[a-z]{2,6}( [a-z]{2,6}){1,3}", completion.text), completion.text
        assert len(completion.logprobs) == len(completion.token_ids)


def test_mixed_batch_of_64_with_preemption(llm):
    """32 constrained + 32 free requests in one batch on a KV cache that must preempt:
    every constraint holds, free requests are token-identical to a run without
    constrained neighbours, and nothing compiles after warm-up."""
    free_prompts = [f"Story {i}: once upon a time there was a" for i in range(32)]
    free_params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(free_prompts, free_params, use_tqdm=False)

    kinds = []
    prompts: list = []
    params: list = []
    for i in range(32):
        kind = i % 4
        kinds.append(kind)
        if kind == 0:
            prompts.append(f"JSON {i}:")
            params.append(constrained(40, json=MIXED_SCHEMAS[i % len(MIXED_SCHEMAS)]))
        elif kind == 1:
            prompts.append(f"Date {i}:")
            params.append(constrained(20, regex=REGEXES[0]))
        elif kind == 2:
            prompts.append(f"Question {i}: which city?")
            params.append(constrained(10, choice=CHOICES[1]))
        else:
            prompts.append(f"Sentiment {i}:")
            params.append(constrained(10, choice=CHOICES[0]))
    # Interleave constrained and free requests.
    order = [("c", i) for i in range(32)] + [("f", i) for i in range(32)]
    order = [x for pair in zip(order[:32], order[32:]) for x in pair]
    all_prompts = [prompts[i] if k == "c" else free_prompts[i] for k, i in order]
    all_params = [params[i] if k == "c" else free_params for k, i in order]

    compiled = llm.llm_engine.num_compilations
    preempted = num_preemptions(llm)
    outputs = llm.generate(all_prompts, all_params, use_tqdm=False)
    assert num_preemptions(llm) > preempted, "the KV pool was meant to force preemption"
    assert llm.llm_engine.num_compilations == compiled, "a program compiled after warm-up"

    for (k, i), out in zip(order, outputs):
        completion = out.outputs[0]
        if k == "f":
            assert completion.token_ids == alone[i].outputs[0].token_ids, i
            continue
        text = completion.text
        if kinds[i] == 0:
            check_json(text, MIXED_SCHEMAS[i % len(MIXED_SCHEMAS)])
        elif kinds[i] == 1:
            assert re.fullmatch(REGEXES[0], text), text
        elif kinds[i] == 2:
            assert text in CHOICES[1]
        else:
            assert text in CHOICES[0]


def test_invalid_constraint_is_a_value_error_and_engine_keeps_serving(llm):
    with pytest.raises(ValueError, match="StructuredOutputsParams.regex is invalid"):
        llm.generate(["x"], constrained(5, regex="[unclosed"), use_tqdm=False)
    (out,) = llm.generate(["Pick:"], constrained(5, choice=["a", "b"]), use_tqdm=False)
    assert out.outputs[0].text in ("a", "b")


def test_constraints_hold_on_a_quantized_engine(smollm2_gguf):
    """The same constraints on SmolLM2 with its Q4_1 blocks kept (--quantization gguf):
    the grammar masks the quantized model's logits like the float one's."""
    import xlm
    from tests.engine.reference import SMOLLM2_ENGINE

    quantized = xlm.LLM(model=smollm2_gguf, quantization="gguf", **SMOLLM2_ENGINE)
    tokenizer = quantized.get_tokenizer()
    schemas = [SCHEMAS[0], SCHEMAS[1], SCHEMAS[6]]
    prompts = [chat_prompt(tokenizer, QUESTIONS[i]) for i in (0, 1, 6)]
    params = [constrained(120, json=schema) for schema in schemas]
    prompts += [chat_prompt(tokenizer, "Answer briefly: is the sky blue?")] * 2
    params += [constrained(40, regex=REGEXES[0]), constrained(10, choice=CHOICES[1])]
    outs = [o.outputs[0] for o in quantized.generate(prompts, params, use_tqdm=False)]
    for schema, out in zip(schemas, outs):
        assert out.finish_reason == "stop", (out.text, out.finish_reason)
        check_json(out.text, schema)
    assert re.fullmatch(REGEXES[0], outs[3].text), outs[3].text
    assert outs[4].text in CHOICES[1] and outs[4].finish_reason == "stop"
