"""A fake model runner that plays the worker's side of the scheduler contract.

It keeps its own copy of every request (as the real runner does), simulates a paged KV
cache whose slot contents identify the token prefix they were computed from, checks every
K/V read (a cache hit must hold exactly the right content), and samples the next token as
a deterministic function of all previous tokens.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

from xlm.core.block_pool import FreeKVCacheBlockQueue, KVCacheBlock
from xlm.core.outputs import ModelRunnerOutput, SchedulerOutput
from xlm.core.request import Request, RequestStatus
from xlm.core.scheduler import Scheduler

_MASK = (1 << 61) - 1


@dataclass
class SP:
    """The fields of SamplingParams the scheduler reads."""

    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None


def make_request(
    request_id: str,
    prompt: list[int],
    eos: int | None = None,
    arrival_time: float | None = None,
    priority: int = 0,
    cache_salt: str | None = None,
    **sp: object,
) -> Request:
    """A Request with a test SamplingParams."""
    return Request(
        request_id, list(prompt), SP(**sp), eos, arrival_time or 0.0, priority, cache_salt
    )


def prefix_value(parent: int, token: int) -> int:
    """The simulated K/V of a position: a hash chaining every token up to it."""
    return (parent * 1_000_003 + token * 7919 + 1) & _MASK


@dataclass
class _State:
    prompt: list[int]
    tokens: list[int]
    block_ids: list[list[int]] | None  # one list per KV cache group
    num_computed: int
    values: list[int] = field(default_factory=list)

    def value(self, pos: int) -> int:
        vals, toks = self.values, self.tokens
        while len(vals) <= pos:
            parent = vals[-1] if vals else 0
            vals.append(prefix_value(parent, toks[len(vals)]))
        return vals[pos]


class FakeModelRunner:
    """Turns a SchedulerOutput into a ModelRunnerOutput, checking the contract on the way."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        vocab: int = 1000,
        check_kv: bool = True,
        window: int | None = None,
        group_windows: list[int | None] | None = None,
        spec_k: int = 0,
        seed: int = 0,
    ):
        # window: attention sees only the last `window` positions; the scheduler may drop
        # (null) the blocks before that, and only in-window reads are checked.
        # group_windows: KV cache groups (block ids come as one list per group), each with
        # its own window; every group's K/V is written and checked in the same block space,
        # tagged with the group, so two groups sharing a block or a hit from another
        # group's cache is caught.
        self.grouped = group_windows is not None
        self.windows = list(group_windows) if self.grouped else [window]
        self.block_size = block_size
        self.vocab = vocab
        self.check_kv = check_kv
        self.kv: list[list[object]] = [[None] * block_size for _ in range(num_blocks)]
        self.reqs: dict[str, _State] = {}
        # Speculative decoding: after each sample, propose spec_k tokens of which a random
        # number are right (the rest wrong), and verify scheduled proposals as the device
        # does (accept the matching prefix, then the model's own token).
        self.spec_k = spec_k
        self.rng = random.Random(seed)
        self.num_accepted = 0
        # The host KV tier's memory: slot -> a block's K/V (xlm.core.host_kv_tier).
        self.host: dict[int, list[object]] = {}

    def _groups(self, block_ids) -> list[list[int]]:
        """Block ids from the scheduler as one list per group."""
        if self.grouped:
            assert isinstance(block_ids, tuple) and len(block_ids) == len(self.windows)
            return [list(ids) for ids in block_ids]
        return [list(block_ids)]

    def _first(self, g: int, num_computed: int) -> int:
        """First position group g's next query (at num_computed) reads."""
        window = self.windows[g]
        return 0 if window is None else max(0, num_computed - window + 1)

    def _no_live_null(self, block_ids, num_computed: int) -> bool:
        """The null block stands only for blocks entirely before the window."""
        return all(
            0 not in ids[self._first(g, num_computed) // self.block_size :]
            for g, ids in enumerate(self._groups(block_ids))
        )

    def next_token(self, state: _State, last_pos: int) -> int:
        """Greedy 'sampling': a deterministic function of every token up to last_pos."""
        return state.value(last_pos) % self.vocab

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step."""
        bs = self.block_size
        transfers = so.kv_transfers
        if transfers is not None:
            # As the worker does: saves read the blocks before this step writes them, then
            # loads fill their blocks; every read below checks what a load brought in.
            for block_id, slot in zip(transfers.save_block_ids, transfers.save_slots):
                assert block_id != 0, "the null block is never saved"
                self.host[slot] = list(self.kv[block_id])
            for slot, block_id in zip(transfers.load_slots, transfers.load_block_ids):
                assert block_id != 0, "nothing is loaded into the null block"
                self.kv[block_id] = list(self.host[slot])
        for rid in so.finished_req_ids:
            self.reqs.pop(rid, None)
        for rid in so.preempted_req_ids:
            self.reqs[rid].block_ids = None  # dropped from the batch until resumed
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.reqs
            assert self._no_live_null(new.block_ids, new.num_computed_tokens)
            self.reqs[new.req_id] = _State(
                list(new.prompt_token_ids),
                list(new.prompt_token_ids),
                self._groups(new.block_ids),
                new.num_computed_tokens,
            )
        c = so.scheduled_cached_reqs
        for i, rid in enumerate(c.req_ids):
            st = self.reqs[rid]
            if c.resumed_from_preemption[i]:
                assert self._no_live_null(c.new_block_ids[i], c.num_computed_tokens[i])
                assert st.block_ids is None
                # The scheduler's outputs must agree with what this runner sampled.
                assert st.tokens[len(st.prompt) :] == c.new_token_ids[i]
                st.tokens = st.prompt + list(c.new_token_ids[i])
                st.values = []
                st.block_ids = self._groups(c.new_block_ids[i])
                st.num_computed = c.num_computed_tokens[i]
            else:
                assert c.new_token_ids[i] == []
                assert st.num_computed == c.num_computed_tokens[i]
                for ids, new_ids in zip(st.block_ids, self._groups(c.new_block_ids[i])):
                    assert 0 not in new_ids, "new blocks are never the null block"
                    ids.extend(new_ids)
        assert set(so.num_scheduled_tokens) == {n.req_id for n in so.scheduled_new_reqs} | set(
            c.req_ids
        )
        assert sum(so.num_scheduled_tokens.values()) == so.total_num_scheduled_tokens
        # Proposals follow a request's last known token and are computed like known ones.
        num_known = {}
        for rid, drafts in so.scheduled_spec_decode_tokens.items():
            assert self.spec_k and 0 < len(drafts) <= self.spec_k
            st = self.reqs[rid]
            assert st.num_computed == len(st.tokens) - 1, "proposals only in a decode step"
            assert so.num_scheduled_tokens[rid] == 1 + len(drafts)
            num_known[rid] = len(st.tokens)
            st.tokens = st.tokens + list(drafts)
        # Every scheduled token's K/V is written before any attention reads.
        for rid, n in so.num_scheduled_tokens.items():
            st = self.reqs[rid]
            start, end = st.num_computed, st.num_computed + n
            assert n > 0 and end <= len(st.tokens), (rid, start, n, len(st.tokens))
            for g, ids in enumerate(st.block_ids):
                assert len(ids) * bs >= end, "not enough slots allocated"
                # Rejected proposals leave their blocks with the request (spec only).
                needed = -(-end // bs)
                assert len(ids) >= needed if self.spec_k else len(ids) == needed, (
                    "more blocks than needed"
                )
                # Blocks dropped out of the window keep stale ids here (the scheduler does
                # not tell the runner): only the blocks still visible must be real, and no
                # two groups or requests write one block (checked by the tagged values).
                live = ids[self._first(g, start) // bs :]
                assert 0 not in live and len(set(live)) == len(live)
                if self.check_kv:
                    for p in range(start, end):
                        self.kv[ids[p // bs]][p % bs] = (g, st.value(p))
        req_ids, sampled = [], []
        for rid, n in so.num_scheduled_tokens.items():
            st = self.reqs[rid]
            end = st.num_computed + n
            if self.check_kv:
                for g, ids in enumerate(st.block_ids):
                    for p in range(self._first(g, st.num_computed), end):
                        got = self.kv[ids[p // bs]][p % bs]
                        assert got == (g, st.value(p)), f"{rid}: wrong K/V at {p} (group {g})"
            st.num_computed = end
            req_ids.append(rid)
            if rid in num_known:
                sampled.append(self._verify(st, num_known[rid]))
            elif end == len(st.tokens):
                tok = self.next_token(st, end - 1)
                st.tokens.append(tok)
                sampled.append([tok])
            else:
                sampled.append([])
        spec = None
        if self.spec_k:
            spec = [self._propose(self.reqs[r]) if t else [] for r, t in zip(req_ids, sampled)]
        return ModelRunnerOutput(req_ids, sampled, spec_token_ids=spec)

    def _verify(self, st: _State, known: int) -> list[int]:
        """Greedy verification: proposals while they are the model's tokens, then its own."""
        out = []
        pos = known - 1
        while True:
            tok = self.next_token(st, pos)
            out.append(tok)
            pos += 1
            if pos >= len(st.tokens) or st.tokens[pos] != tok:
                break
        self.num_accepted += len(out) - 1
        # Rejected positions are computed again next step (the scheduler rolled back).
        del st.tokens[known + len(out) - 1 :]
        del st.values[len(st.tokens) :]
        st.num_computed = len(st.tokens)
        st.tokens.append(out[-1])
        return out

    def _propose(self, st: _State) -> list[int]:
        """spec_k tokens: a random number of them right, then wrong ones."""
        right = self.rng.randint(0, self.spec_k)
        value, out = st.value(len(st.tokens) - 1), []
        for i in range(self.spec_k):
            tok = value % self.vocab
            if i >= right:
                tok = (tok + 1) % self.vocab
            out.append(tok)
            value = prefix_value(value, tok)
        return out


def reference_generate(
    prompt: list[int],
    vocab: int,
    max_len: int,
    eos: int | None = None,
    max_tokens: int | None = 16,
    min_tokens: int = 0,
    ignore_eos: bool = False,
    stop_token_ids: list[int] | None = None,
) -> tuple[list[int], str, int | None]:
    """What an uncontended run of FakeModelRunner yields: (output tokens, reason, stop_reason)."""
    value, out = 0, []
    for tok in prompt:
        value = prefix_value(value, tok)
    while True:
        tok = value % vocab
        out.append(tok)
        value = prefix_value(value, tok)
        if len(out) >= min_tokens:
            if tok == eos and not ignore_eos:
                return out, "stop", None
            if tok in (stop_token_ids or ()):
                return out, "stop", tok
        if (max_tokens is not None and len(out) >= max_tokens) or len(prompt) + len(out) >= max_len:
            return out, "length", None


def free_queue_blocks(queue: FreeKVCacheBlockQueue) -> list[KVCacheBlock]:
    """The free queue's blocks, head (reused first) to tail, read off its links."""
    out = []
    block = queue._head.next_free_block
    while block is not queue._tail:
        assert block is not None, "a free block's link is broken"
        out.append(block)
        block = block.next_free_block
    return out


def check_invariants(sched: Scheduler, so: SchedulerOutput | None = None) -> None:
    """Block accounting and scheduling limits that must hold after every step."""
    kv = sched.kv_cache_manager
    pool = kv.block_pool
    # One manager per KV cache group, over one pool.
    managers = kv.groups
    owners: Counter[int] = Counter()
    for m in managers:
        for blocks in m.req_to_blocks.values():
            ids = [b.block_id for b in blocks if not b.is_null]
            assert len(set(ids)) == len(ids)
            owners.update(ids)
    assert pool.null_block.ref_cnt == 0 and pool.null_block.block_id == 0
    assert 0 not in owners
    for block in pool.blocks[1:]:
        assert block.ref_cnt == owners[block.block_id], block
        if owners[block.block_id] > 1:
            assert block.block_hash is not None, f"{block} shared but not a cached block"
    free = free_queue_blocks(pool.free_block_queue)
    assert len(free) == pool.get_num_free_blocks()
    assert {b.block_id for b in free} == {b.block_id for b in pool.blocks[1:] if b.ref_cnt == 0}
    prev = pool.free_block_queue._head
    for b in free:
        assert b.prev_free_block is prev and prev.next_free_block is b
        prev = b
    for h, b in pool.cached_block_hash_to_block.items():
        assert b.block_hash == h
    running_ids = {r.request_id for r in sched.running}
    assert len(running_ids) == len(sched.running) <= sched.max_num_seqs
    for m in managers:
        assert set(m.req_to_blocks) == running_ids
        if m.sliding_window is not None:
            # A request scheduled for `new` tokens holds only the blocks of positions
            # [computed - window + 1, computed + new): at most ceil((window - 1 + new) / bs) + 1.
            for rid, new in (so.num_scheduled_tokens if so is not None else {}).items():
                bound = -(-(m.sliding_window - 1 + new) // m.block_size) + 1
                held = m.num_held_blocks(rid)
                assert held <= bound, (rid, held, bound, new)
        for r in sched.running:
            assert len(m.req_to_blocks[r.request_id]) * m.block_size >= r.num_computed_tokens
    # Groups of one window hold alike (the hybrid manager's decode fast path checks one).
    by_window: dict[int | None, object] = {}
    for m in managers:
        first = by_window.setdefault(m.sliding_window, m)
        for rid in running_ids:
            assert len(m.req_to_blocks[rid]) == len(first.req_to_blocks[rid])
            assert m.num_cached_block[rid] == first.num_cached_block[rid]
            assert m.num_dropped_block[rid] == first.num_dropped_block[rid]
    for r in sched.running:
        assert r.status == RequestStatus.RUNNING
        # No K/V slot past the longest request (proposals are trimmed to it).
        assert r.num_computed_tokens <= sched.max_request_len, r
    for r in sched.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert r.num_computed_tokens == 0
    assert len(sched.requests) == len(sched.running) + len(sched.waiting)
    if so is not None:
        assert so.total_num_scheduled_tokens <= sched.max_num_batched_tokens
        assert len(so.num_scheduled_tokens) <= sched.max_num_seqs
        assert all(n > 0 for n in so.num_scheduled_tokens.values())


def run_to_completion(
    sched: Scheduler,
    runner: FakeModelRunner,
    max_steps: int = 10_000,
    check: bool = True,
    on_step=None,
) -> dict[str, tuple[list[int], str | None, int | str | None]]:
    """Step until nothing is unfinished; returns request_id -> (tokens, reason, stop_reason)."""
    results: dict[str, tuple[list[int], str | None, int | str | None]] = {}
    for step in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        if check:
            check_invariants(sched, so)
        out = sched.update_from_output(so, runner.execute(so))
        for o in out:
            toks, _, _ = results.get(o.request_id, ([], None, None))
            results[o.request_id] = (toks + o.new_token_ids, o.finish_reason, o.stop_reason)
        if check:
            check_invariants(sched)
        if on_step is not None:
            on_step(step, so, out)
    else:
        raise AssertionError(f"requests still unfinished after {max_steps} steps")
    return results
