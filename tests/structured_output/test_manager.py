"""The structured-output manager and the scheduler with real llguidance grammars on the
SmolLM2 tokenizer (no model): compile caching, bitmasks against the tokens of known-good
and known-bad outputs, grammar completion, rejected tokens, reasoning gating, grammar
errors; the scheduler waits for grammars and fails only the offending request."""

from __future__ import annotations

import numpy as np

from xlm import SamplingParams, StructuredOutputsParams
from xlm.config import CacheConfig, SchedulerConfig
from xlm.core.outputs import ModelRunnerOutput
from xlm.core.request import Request
from xlm.core.scheduler import Scheduler
from xlm.structured_output.manager import StructuredOutputManager

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 99}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


def make_manager(tokenizer, **kwargs):
    return StructuredOutputManager(lambda: tokenizer, len(tokenizer), [2], **kwargs)


def ready(manager, params, prompt=(1,)):
    request = manager.init_request(params, list(prompt))
    request.future.result(timeout=60)
    assert request.is_ready()
    return request


def allowed(bitmask_row, vocab_size):
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")[:vocab_size]
    return set(np.flatnonzero(bits).tolist())


def test_bitmask_follows_a_valid_output_and_completes(tokenizer):
    manager = make_manager(tokenizer)
    request = ready(manager, StructuredOutputsParams(json=SCHEMA, whitespace_pattern=""))
    ids = tokenizer.encode('{"ok":true,"n":42}')
    vocab = len(tokenizer)
    for i, token in enumerate(ids):
        mask = allowed(manager.grammar_bitmask([request])[0], vocab)
        assert token in mask
        assert tokenizer.encode("hello")[0] not in mask  # never valid inside this JSON
        verdict = manager.advance(request, [token])
        assert verdict == ("stop" if i == len(ids) - 1 else None)
    manager.shutdown()


def test_compile_cache_and_rejected_token(tokenizer):
    manager = make_manager(tokenizer)
    params = StructuredOutputsParams(choice=["alpha", "beta"])
    first = ready(manager, params)
    second = ready(manager, StructuredOutputsParams(choice=["alpha", "beta"]))
    compiler = manager.compiler
    assert compiler.num_compiled == 1 and compiler.num_cache_hits == 1
    assert first.matcher is not second.matcher  # each request has its own state
    bad = tokenizer.encode(" zebra")[0]
    verdict = manager.advance(first, [bad])
    assert verdict is not None and verdict != "stop" and "rejected" in verdict
    # The other request's matcher is untouched.
    assert manager.advance(second, tokenizer.encode("beta")) == "stop"
    manager.shutdown()


def test_invalid_grammar_fails_the_request_only(tokenizer):
    manager = make_manager(tokenizer)
    request = manager.init_request(StructuredOutputsParams(grammar="start: nowhere"), [1])
    request.future.exception(timeout=60)
    assert request.is_ready() and request.error and "grammar" in request.error
    manager.shutdown()


def test_constraint_applies_after_reasoning_ends(tokenizer):
    manager = make_manager(tokenizer, reasoning_parser="deepseek_r1")
    vocab = len(tokenizer)
    request = ready(manager, StructuredOutputsParams(choice=["yes", "no"]))
    assert not request.is_constraining
    assert len(allowed(manager.grammar_bitmask([request])[0], vocab)) == vocab
    assert manager.advance(request, tokenizer.encode("Let me think. </think>")) is None
    assert request.is_constraining
    mask = allowed(manager.grammar_bitmask([request])[0], vocab)
    assert tokenizer.encode("yes")[0] in mask and len(mask) < 10
    # A prompt that already closed its reasoning (e.g. thinking switched off) starts
    # constrained.
    closed = tokenizer.encode("<think>\n\n</think>\n\n")
    assert ready(manager, StructuredOutputsParams(choice=["yes"]), closed).is_constraining
    # enable_in_reasoning: constrained from the first token.
    eager = make_manager(tokenizer, reasoning_parser="deepseek_r1", enable_in_reasoning=True)
    assert ready(eager, StructuredOutputsParams(choice=["yes"])).is_constraining
    manager.shutdown()
    eager.shutdown()


def test_scheduler_waits_for_grammars_and_fails_only_the_bad_request(tokenizer):
    manager = make_manager(tokenizer)
    sched = Scheduler(
        SchedulerConfig(64, 8, 128, True, 0, "fcfs"), CacheConfig(block_size=4), 64, manager
    )

    def add(rid, constraint):
        params = SamplingParams(max_tokens=8, structured_outputs=constraint)
        sched.add_request(Request(rid, [5, 6, 7], params, eos_token_id=2))

    add("good", StructuredOutputsParams(choice=["yes", "no"]))
    add("bad", StructuredOutputsParams(grammar="start: nowhere"))
    add("free", None)
    add("reject", StructuredOutputsParams(choice=["yes", "no"]))
    finished = {}
    yes = tokenizer.encode("yes")
    zebra = tokenizer.encode(" zebra")[0]
    for _ in range(200):
        so = sched.schedule()
        if not so.num_scheduled_tokens and manager.has_pending:
            manager.wait_for_any(0.1)
        # Rows of the bitmask are exactly the constrained requests that sample now.
        assert len(so.structured_output_request_ids) == (
            0 if so.grammar_bitmask is None else so.grammar_bitmask.shape[0]
        )
        assert "free" not in so.structured_output_request_ids
        ids = list(so.num_scheduled_tokens)
        tokens = {"good": yes[0], "free": 11, "reject": zebra}
        out = sched.update_from_output(so, ModelRunnerOutput(ids, [[tokens[r]] for r in ids]))
        for o in out:
            if o.finished:
                finished[o.request_id] = (o.finish_reason, o.stop_reason)
        if not sched.has_unfinished_requests():
            break
    assert finished["good"] == ("stop", None)  # "yes" completes the grammar in one token
    assert finished["bad"][0] == "error" and "grammar" in finished["bad"][1]
    assert finished["reject"][0] == "error" and "rejected" in finished["reject"][1]
    assert finished["free"][0] == "length"
    assert sched.requests == {} and sched.kv_cache_manager.usage == 0
    manager.shutdown()
