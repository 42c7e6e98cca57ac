"""Property test: random arrivals, lengths, aborts and tiny pools, invariants every step."""

from collections import deque

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.core.sim import (
    FakeModelRunner,
    check_invariants,
    make_request,
    reference_generate,
)
from xlm.config import CacheConfig, SchedulerConfig
from xlm.core.async_scheduler import AsyncScheduler
from xlm.core.kv_cache_groups import KVCacheGroupSpec
from xlm.core.request import RequestStatus
from xlm.core.scheduler import Scheduler

VOCAB = 40
EOS = 0

configs = st.fixed_dictionaries(
    {
        "block_size": st.sampled_from([1, 2, 4, 8]),
        "num_blocks": st.integers(2, 32),
        "budget": st.integers(1, 48),
        "max_seqs": st.integers(1, 6),
        "max_len": st.integers(4, 48),
        "chunked": st.booleans(),
        "threshold": st.sampled_from([0, 0, 3, 7]),
        "policy": st.sampled_from(["fcfs", "priority"]),
        "caching": st.sampled_from([True, True, False]),
        "window": st.sampled_from([None, None, 1, 3, 8]),
        # KV cache groups by window (Gemma 2: full + window; Gemma 3: one full, several
        # windowed; two windows without full attention); None: one block table.
        "groups": st.sampled_from(
            [None, None, None, (None, 3), (None, 8), (None, 1, 3), (None, 3, 3, 3), (3, 8)]
        ),
        # Async scheduling: step N+1 is scheduled (and run) before step N's outputs are
        # applied, as EngineCore does; the fake runner, like the device, already knows
        # the tokens the scheduler counts as in flight.
        "async": st.booleans(),
        # Speculative decoding (synchronous scheduling only, as the engine turns async
        # off with it): proposals of this many tokens, some right, some wrong.
        "spec_k": st.sampled_from([0, 1, 3]),
    }
)

request_specs = st.fixed_dictionaries(
    {
        "prefix": st.integers(0, 2),  # which shared prefix, if any
        "prefix_len": st.sampled_from([0, 3, 9, 12, 16]),
        "tail": st.lists(st.integers(1, VOCAB - 1), min_size=0, max_size=12),
        "max_tokens": st.integers(1, 20),
        "min_tokens": st.integers(0, 3),
        "ignore_eos": st.booleans(),
        "stop": st.lists(st.integers(1, VOCAB - 1), max_size=2),
        "priority": st.integers(0, 2),
        "salt": st.sampled_from([None, None, None, "s"]),
    }
)

# One entry per step: requests arriving before it, and which live requests to abort.
steps = st.lists(
    st.tuples(st.lists(request_specs, max_size=3), st.lists(st.integers(0, 50), max_size=1)),
    min_size=1,
    max_size=40,
)

PREFIXES = [[(7 * i + 3 * k) % (VOCAB - 1) + 1 for i in range(16)] for k in range(3)]


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs, plan=steps)
def test_random_workloads_keep_invariants_and_finish(cfg, plan):
    bs = cfg["block_size"]
    budget = cfg["budget"] if cfg["chunked"] else max(cfg["budget"], cfg["max_len"])
    windows = cfg["groups"]
    groups = None if windows is None else [KVCacheGroupSpec(w, (i,)) for i, w in enumerate(windows)]
    window = None if groups else cfg["window"]
    sched = (AsyncScheduler if cfg["async"] else Scheduler)(
        SchedulerConfig(
            budget,
            cfg["max_seqs"],
            cfg["max_len"],
            cfg["chunked"],
            cfg["threshold"],
            cfg["policy"],
            async_scheduling=cfg["async"],
        ),
        CacheConfig(
            block_size=bs,
            enable_prefix_caching=cfg["caching"],
            sliding_window=window,
            kv_cache_groups=groups,
        ),
        cfg["num_blocks"],
    )
    spec_k = 0 if cfg["async"] else cfg["spec_k"]
    runner = FakeModelRunner(
        cfg["num_blocks"], bs, vocab=VOCAB, window=window, group_windows=windows, spec_k=spec_k
    )
    kv = sched.kv_cache_manager
    cap = min(cfg["max_len"], kv.max_request_tokens)
    event(f"groups: {windows is not None}")
    event(f"async: {cfg['async']}")
    event(f"spec: {spec_k > 0}")
    specs, aborted, results = {}, set(), {}
    in_flight = deque()

    def unfinished():
        return sched.has_unfinished_requests() or bool(in_flight)

    def do_step():
        if sched.has_unfinished_requests():
            so = sched.schedule()
            check_invariants(sched, so)
            if not cfg["chunked"]:
                for new in so.scheduled_new_reqs:
                    assert so.num_scheduled_tokens[new.req_id] + new.num_computed_tokens == len(
                        new.prompt_token_ids
                    )
            in_flight.append((so, runner.execute(so)))
            if cfg["async"] and len(in_flight) < 2 and so.total_num_scheduled_tokens:
                return  # the next step is scheduled before this one's outputs are applied
        so, runner_output = in_flight.popleft()
        for out in sched.update_from_output(so, runner_output):
            toks, _, _ = results.get(out.request_id, ([], None, None))
            results[out.request_id] = (toks + out.new_token_ids, out.finish_reason, out.stop_reason)
        check_invariants(sched)

    n = 0
    for arrivals, aborts in plan:
        for spec in arrivals:
            body = PREFIXES[spec["prefix"]][: spec["prefix_len"]] + spec["tail"]
            rid = f"r{n}"
            n += 1
            req = make_request(
                rid,
                body,
                eos=EOS,
                arrival_time=float(n),
                priority=spec["priority"],
                cache_salt=spec["salt"],
                max_tokens=spec["max_tokens"],
                min_tokens=spec["min_tokens"],
                ignore_eos=spec["ignore_eos"],
                stop_token_ids=spec["stop"],
            )
            if not body or not kv.can_fit(len(body)) or len(body) > cfg["max_len"]:
                try:
                    sched.add_request(req)
                except ValueError:
                    continue
                raise AssertionError(f"prompt of {len(body)} > {cap} accepted")
            sched.add_request(req)
            specs[rid] = (body, spec)
        for k in aborts:
            live = sorted(sched.requests)
            if live:
                rid = live[k % len(live)]
                sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
                aborted.add(rid)
        if unfinished():
            do_step()

    for _ in range(3000):
        if not unfinished():
            break
        do_step()
    assert not unfinished(), "a request never finished"
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == cfg["num_blocks"] - 1
    stats = sched.make_stats()
    event(f"preempted: {stats.num_preemptions > 0}")
    event(f"prefix hits: {stats.prefix_cache_hits > 0}")
    event(f"aborted: {bool(aborted)}")
    event(f"spec accepted: {runner.num_accepted > 0}")
    assert stats.spec_num_accepted_tokens == runner.num_accepted

    for rid, (body, spec) in specs.items():
        if rid in aborted:
            continue
        expected = reference_generate(
            body,
            VOCAB,
            cap,
            EOS,
            spec["max_tokens"],
            spec["min_tokens"],
            spec["ignore_eos"],
            spec["stop"],
        )
        assert results[rid] == expected, rid
