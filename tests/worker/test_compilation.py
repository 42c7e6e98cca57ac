"""Start-up without compiling everything first: programs made ready on first use or in the
background, steps in the next larger ready bucket meanwhile, damaged saved programs
recompiled. Each engine gets an empty program cache, so its programs really compile."""

from __future__ import annotations

import logging

import pytest

import xlm
from xlm import SamplingParams, disk_cache
from xlm.worker.compilation import ProgramKind, ProgramStore

# Default token buckets up to 16 (1, 2, 4, 8, 16), few enough that each engine's programs
# compile quickly, enough for steps to run in a larger ready bucket than their own.
ENGINE = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=16, seed=0)
# Prompt lengths whose first steps land in every token bucket from 2 to 16 (decode steps
# cover 1); run one by one, then all together (chunked to 16-token steps).
LENGTHS = [2, 3, 6, 12, 1, 9]
SINGLES = 4


def _prompts(n: int = len(LENGTHS)) -> list[list[int]]:
    return [[3 + (7 * i + j) % 90 for j in range(length)] for i, length in enumerate(LENGTHS[:n])]


def _params() -> list[SamplingParams]:
    greedy = [SamplingParams(max_tokens=6 + i, temperature=0.0, ignore_eos=True) for i in range(4)]
    seeded = [
        SamplingParams(max_tokens=8, temperature=0.9, top_k=20, seed=11 + i, ignore_eos=True)
        for i in range(2)
    ]
    return greedy + seeded


def _run(llm: xlm.LLM, singles: int = SINGLES) -> list[list[int]]:
    """Token ids of the first `singles` prompts one request at a time, then of all at once."""
    prompts, params = _prompts(), _params()
    calls = [([p], [q]) for p, q in zip(prompts[:singles], params[:singles])] + [(prompts, params)]
    return [
        list(o.outputs[0].token_ids)
        for batch, ps in calls
        for o in llm.generate(batch, ps, use_tqdm=False)
    ]


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def compiled_all(model, tmp_path_factory, monkeypatch_module):
    """Token ids of an engine that compiled every program first, and the directory it
    saved them in."""
    directory = tmp_path_factory.mktemp("ref")
    monkeypatch_module.setenv("XLM_COMPILATION_CACHE_DIR", str(directory))
    llm = xlm.LLM(model=model, startup_programs="all", **ENGINE)
    compiler = _runner(llm).program_store
    assert compiler.all_ready and compiler.num_compiled == compiler.num_registered
    return _run(llm), directory


@pytest.fixture(scope="module")
def reference(compiled_all):
    return compiled_all[0]


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _runner(llm: xlm.LLM):
    return llm.llm_engine.engine_core.engine_core.executor.worker.model_runner


def test_first_use_pads_to_ready_buckets_and_equals_compile_all(
    model, reference, tmp_path, monkeypatch
):
    monkeypatch.setenv("XLM_COMPILATION_CACHE_DIR", str(tmp_path / "programs"))
    llm = xlm.LLM(model=model, **ENGINE)
    runner = _runner(llm)
    compiler = runner.program_store
    assert llm.llm_engine.num_compilations == 0  # nothing compiled before the first step
    total = compiler.num_registered
    # No background thread during the first generate: only programs steps asked for exist,
    # and steps whose own bucket is missing run in a larger ready one.
    monkeypatch.setattr(ProgramStore, "start_background", lambda self, order: None)
    buckets: list[tuple[int, int]] = []
    choose = runner.readiness.ready_bucket

    def spy(num_tokens: int, real_rows: int) -> int:
        bucket = choose(num_tokens, real_rows)
        buckets.append((runner.buckets.token_bucket(num_tokens), bucket))
        return bucket

    monkeypatch.setattr(runner.readiness, "ready_bucket", spy)
    assert _run(llm) == reference
    assert 0 < compiler.num_compiled < total, "first use compiles only what steps asked for"
    assert any(chosen > exact for exact, chosen in buckets), "no step ran in a larger bucket"
    assert {exact for exact, _ in buckets} == set(runner.buckets.token_buckets)

    # The background thread makes the rest ready; then no step compiles again.
    monkeypatch.undo()
    compiler.start_background(runner.readiness.background_order())
    assert llm.wait_for_programs(timeout=300)
    assert compiler.num_ready == total
    compiled = llm.llm_engine.num_compilations
    assert _run(llm) == reference
    assert llm.llm_engine.num_compilations == compiled, "a step compiled after the background"


def test_used_compiles_only_the_programs_its_steps_run(model, reference, tmp_path, monkeypatch):
    """Start-up mode "used" (`xlm generate`) compiles a step's model and the one sampler its
    rows take, not its bucket's other sampler: a 12-token prompt's prefill (and its
    decodes, padded into that ready bucket) run the 16-token model with the few-rows
    sampler."""
    monkeypatch.setenv("XLM_COMPILATION_CACHE_DIR", str(tmp_path / "programs"))
    llm = xlm.LLM(model=model, startup_programs="used", **{**ENGINE, "max_num_seqs": 16})
    runner = _runner(llm)
    model16, *samplers = runner.readiness.bucket_keys(16)
    assert [k.size for k in samplers] == [16, 8]  # its logit rows' sampler, and few rows'
    out = llm.generate([_prompts()[3]], [_params()[3]], use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == reference[3]
    store = runner.program_store
    assert store.is_ready(model16) and store.is_ready(samplers[1])
    assert not store.is_ready(samplers[0])
    assert store.num_compiled == 2


def test_used_runs_a_step_past_the_fine_buckets_in_its_own_bucket(model, tmp_path, monkeypatch):
    """ "used" compiles nothing in the background: a decode after a 40-token prompt (its
    prefill in the 48-token bucket) compiles its own bucket rather than running padded into
    48, which it then did for the rest of the request (on an H200 a 64-request decode ran in
    the 2048-token bucket). Decodes up to the first fine bucket (16) may still take a larger
    ready one. The tokens equal those of an engine prefilling in 16-token chunks."""
    monkeypatch.setenv("XLM_COMPILATION_CACHE_DIR", str(tmp_path / "programs"))
    prompt = [[3 + (5 * j) % 90 for j in range(40)]]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    llm = xlm.LLM(model=model, startup_programs="used", **{**ENGINE, "max_num_batched_tokens": 64})
    runner = _runner(llm)
    choose, buckets = runner.readiness.ready_bucket, []

    def spy(num_tokens: int, real_rows: int) -> int:
        buckets.append((runner.buckets.token_bucket(num_tokens), choose(num_tokens, real_rows)))
        return buckets[-1][1]

    monkeypatch.setattr(runner.readiness, "ready_bucket", spy)
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert buckets[0] == (48, 48) and len(buckets) == 5
    assert all(exact == 1 and chosen <= 16 for exact, chosen in buckets[1:]), buckets
    chunked = xlm.LLM(model=model, startup_programs="used", **ENGINE)
    assert out == chunked.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


def test_largest_first_serves_while_background_compiles(model, reference, tmp_path, monkeypatch):
    monkeypatch.setenv("XLM_COMPILATION_CACHE_DIR", str(tmp_path / "programs"))
    llm = xlm.LLM(model=model, startup_programs="largest", **ENGINE)
    compiler = _runner(llm).program_store
    # Ready at start: the largest bucket's model and sampler programs (or more, once the
    # background thread got going), never all of them.
    assert 2 <= compiler.num_ready < compiler.num_registered
    assert _run(llm) == reference
    assert llm.wait_for_programs(timeout=300)
    compiled = llm.llm_engine.num_compilations
    assert _run(llm, singles=0) == reference[SINGLES:]
    assert llm.llm_engine.num_compilations == compiled


def test_damaged_saved_programs_are_recompiled_with_a_warning(
    model, compiled_all, tmp_path, monkeypatch, caplog
):
    reference, saved_by_reference = compiled_all
    directory = tmp_path / "programs"
    directory.mkdir()
    for saved in saved_by_reference.iterdir():  # checksummed entries holding no program
        disk_cache.write_entry(directory / saved.name, b"not a compiled program")
    monkeypatch.setenv("XLM_COMPILATION_CACHE_DIR", str(directory))
    xlm_logger = logging.getLogger("xlm")  # it does not propagate to caplog's root handler
    xlm_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="xlm"):
            llm = xlm.LLM(model=model, **ENGINE)
            assert _run(llm) == reference
            assert llm.wait_for_programs(timeout=300)
    finally:
        xlm_logger.removeHandler(caplog.handler)
    compiler = _runner(llm).program_store
    assert len(list(saved_by_reference.iterdir())) == compiler.num_registered
    assert compiler.num_compiled == compiler.num_registered and compiler.num_loaded == 0
    assert "unreadable cached program" in caplog.text


def test_another_models_engine_loads_the_saved_samplers(compiled_all, tiny_checkpoint, tmp_path):
    """Samplers read only logits: an engine of another model with the same vocabulary and
    limits loads the ones the first engine saved and compiles only its model's programs,
    and draws exactly what the same engine compiling everything itself draws (seeded rows
    included)."""
    _, saved_by_llama = compiled_all
    other = tiny_checkpoint("qwen3")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XLM_COMPILATION_CACHE_DIR", str(tmp_path / "alone"))
        alone = xlm.LLM(model=other, startup_programs="all", **ENGINE)
        expected = _run(alone)
        del alone
        mp.setenv("XLM_COMPILATION_CACHE_DIR", str(saved_by_llama))
        shared = xlm.LLM(model=other, startup_programs="all", **ENGINE)
    runner = _runner(shared)
    store = runner.program_store
    keys = {
        k for bucket in runner.buckets.token_buckets for k in runner.readiness.bucket_keys(bucket)
    }
    samplers = [k for k in keys if k.kind is ProgramKind.SAMPLER]
    assert samplers and store.num_loaded == len(samplers), (store.num_loaded, len(samplers))
    assert store.num_compiled == store.num_registered - len(samplers)
    assert _run(shared) == expected
