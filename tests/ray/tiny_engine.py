"""The tiny engine every Ray test runs: LLM(...) keywords and the same as CLI flags."""

from tests.engine_args import cli_flags

ENGINE = dict(
    max_model_len=128,
    max_num_seqs=16,
    max_num_batched_tokens=64,
    token_buckets=[8, 64],
    kv_cache_memory=0.02,
    # Every program ready at start: a test's local reference engine, built before its
    # replicas, compiles them all into the suite's program cache, and the replicas load
    # them (with LLM's lazy "first-use" the reference compiled only after the job, and the
    # replicas each compiled the same programs at once on the same cores).
    startup_programs="all",
)
ENGINE_FLAGS = [*cli_flags(ENGINE), "--disable-log-stats"]
