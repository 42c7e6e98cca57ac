"""The engine core's side of structured outputs: per-request matchers and the step bitmask.

The scheduler asks ``init_request`` when a constrained request arrives (its grammar
compiles in a thread pool while the request waits), ``is_ready`` before admitting it,
``grammar_bitmask`` for the requests a step will sample, and ``advance`` with every
sampled token. Everything here runs on the host; nothing here touches a device.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from xlm.logger import init_logger
from xlm.reasoning import get_reasoning_parser
from xlm.structured_output.backend import GrammarCompiler, make_ll_tokenizer
from xlm.structured_output.params import StructuredOutputsParams

logger = init_logger(__name__)

# Prompt tokens decoded to find whether the prompt already closed the reasoning.
_PROMPT_TAIL_TOKENS = 64


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row of a token bitmask (bit i of word w: token 32 * w + i)."""
    return (vocab_size + 31) // 32


class StructuredOutputRequest:
    """One request's constraint: its matcher (once compiled) and its reasoning state."""

    __slots__ = ("params", "future", "matcher", "error", "reasoning_ended", "_tail")

    def __init__(self, params: StructuredOutputsParams, future: Future) -> None:
        self.params = params
        self.future = future
        self.matcher: Any = None
        self.error: str | None = None
        # False while a reasoning model thinks (no constraint until it stops).
        self.reasoning_ended = True
        self._tail = b""

    def is_ready(self) -> bool:
        """Whether compiling has finished (successfully or with ``error`` set)."""
        if self.matcher is not None or self.error is not None:
            return True
        if not self.future.done():
            return False
        try:
            self.matcher, self.reasoning_ended = self.future.result()
        except Exception as e:  # an invalid grammar fails this request only
            self.error = str(e) or type(e).__name__
        return True

    @property
    def is_constraining(self) -> bool:
        """Whether the next token is constrained (compiled and past any reasoning)."""
        return self.matcher is not None and self.reasoning_ended


class StructuredOutputManager:
    """Compiles constraints off the critical path and keeps the matchers in step."""

    def __init__(
        self,
        tokenizer_factory: Callable[[], Any],
        vocab_size: int,
        eos_token_ids: Sequence[int] = (),
        reasoning_parser: str | None = None,
        enable_in_reasoning: bool = False,
        max_workers: int = 2,
    ) -> None:
        self.vocab_size = vocab_size
        self.num_words = bitmask_words(vocab_size)
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer_factory = tokenizer_factory
        self._init_lock = threading.Lock()
        self._compiler: GrammarCompiler | None = None
        self._executor: Any = None
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="xlm-grammar")
        self.reasoner = None
        if reasoning_parser and not enable_in_reasoning:
            self.reasoner = get_reasoning_parser(reasoning_parser)
        self._pending: set[Future] = set()
        self._pending_lock = threading.Lock()

    # ---- compiling ------------------------------------------------------------------------

    @property
    def compiler(self) -> GrammarCompiler:
        """The grammar compiler (builds llguidance's tokenizer on first use, ~1 s)."""
        with self._init_lock:
            if self._compiler is None:
                tokenizer = self._tokenizer_factory()
                eos = set(self.eos_token_ids)
                if getattr(tokenizer, "eos_token_id", None) is not None:
                    eos.add(tokenizer.eos_token_id)
                ll_tokenizer = make_ll_tokenizer(tokenizer, self.vocab_size, sorted(eos))
                self._compiler = GrammarCompiler(ll_tokenizer)
            return self._compiler

    def _prepare(self, params: StructuredOutputsParams, prompt_token_ids: list[int]) -> Any:
        compiler = self.compiler
        matcher = compiler.matcher(params)
        reasoning_ended = True
        if self.reasoner is not None:
            tail = compiler.ll_tokenizer.decode_bytes(prompt_token_ids[-_PROMPT_TAIL_TOKENS:])
            reasoning_ended = self.reasoner.is_reasoning_end(tail.decode("utf-8", "replace"))
        return matcher, reasoning_ended

    def init_request(
        self, params: StructuredOutputsParams, prompt_token_ids: list[int]
    ) -> StructuredOutputRequest:
        """Start compiling a request's constraint; returns its (not yet ready) state."""
        future = self._pool.submit(self._prepare, params, list(prompt_token_ids))
        with self._pending_lock:
            self._pending.add(future)
        future.add_done_callback(self._discard)
        return StructuredOutputRequest(params, future)

    def _discard(self, future: Future) -> None:
        with self._pending_lock:
            self._pending.discard(future)

    def wait_for_any(self, timeout: float) -> None:
        """Block until some compile finishes (or ``timeout``): the core idles here rather
        than spin when every runnable request waits for its grammar."""
        with self._pending_lock:
            pending = list(self._pending)
        if pending:
            concurrent.futures.wait(
                pending, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED
            )

    @property
    def has_pending(self) -> bool:
        """Whether any grammar is still compiling."""
        return bool(self._pending)

    # ---- each step ------------------------------------------------------------------------

    def grammar_bitmask(self, so_requests: Sequence[StructuredOutputRequest]) -> np.ndarray:
        """Allowed tokens of each request's next token: int32 [len(so_requests), words].

        Rows whose request is still reasoning allow every token.
        """
        bitmask = np.full((len(so_requests), self.num_words), -1, dtype=np.int32)
        rows = [(r.matcher, i) for i, r in enumerate(so_requests) if r.is_constraining]
        if not rows:
            return bitmask
        import llguidance.numpy as llnp

        if len(rows) == 1:
            llnp.fill_next_token_bitmask(rows[0][0], bitmask, rows[0][1])
        else:
            if self._executor is None:
                from llguidance import LLExecutor

                self._executor = LLExecutor()
            llnp.fill_next_token_bitmask_par(self._executor, rows, bitmask)
        return bitmask

    def advance(self, so_request: StructuredOutputRequest, token_ids: Sequence[int]) -> str | None:
        """Feed sampled tokens to the matcher: None while it goes on, "stop" when the
        grammar is complete (accepts and allows nothing more), else an error message."""
        matcher = so_request.matcher
        for token_id in token_ids:
            if not so_request.reasoning_ended:
                self._advance_reasoning(so_request, token_id)
                continue
            if not matcher.consume_token(token_id):
                return (
                    f"structured output: token {token_id} was rejected by the "
                    f"{so_request.params.kind} constraint ({matcher.get_error() or 'no error'})"
                )
            if matcher.is_stopped():
                return "stop"
        return None

    def _advance_reasoning(self, so_request: StructuredOutputRequest, token_id: int) -> None:
        end = self.reasoner.end.encode()
        tail = so_request._tail + self.compiler.ll_tokenizer.decode_bytes([token_id])
        if end in tail:
            so_request.reasoning_ended = True
            so_request._tail = b""
        else:
            so_request._tail = tail[-len(end) :]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
