"""llguidance backend: a constraint -> grammar text -> a compiled matcher for one tokenizer.

Grammars compile in the manager's thread pool (llguidance drops the GIL while it builds
one), and each compiled matcher is kept, by the constraint's cache key, as a template
that new requests ``deep_copy`` (microseconds) instead of compiling again.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

from xlm.logger import init_logger
from xlm.structured_output.params import StructuredOutputsParams

logger = init_logger(__name__)

# Compiled grammars kept per engine (templates; each is a few hundred KB at most).
GRAMMAR_CACHE_SIZE = 256


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON/Lark text) of a constraint; ValueError if unusable."""
    from llguidance import LLMatcher

    kind = params.kind
    options: dict[str, Any] = {"whitespace_flexible": params.whitespace_pattern is None}
    if params.whitespace_pattern is not None:
        options["whitespace_pattern"] = params.whitespace_pattern
    if kind == "json" or kind == "json_object":
        schema = params.json if kind == "json" else {"type": "object"}
        if params.disable_additional_properties and isinstance(schema, dict):
            schema = _close_objects(schema)
        try:
            return LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except ValueError as e:
            raise ValueError(f"StructuredOutputsParams.json is invalid: {e}") from None
    if kind == "regex":
        return LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        lark = "start: " + " | ".join(json.dumps(c) for c in params.choice)
        return LLMatcher.grammar_from_lark(lark)
    return LLMatcher.grammar_from_lark(params.grammar)


def _close_objects(schema: Any) -> Any:
    """A copy of a schema with additionalProperties: false wherever an object leaves it open."""
    if isinstance(schema, list):
        return [_close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _close_objects(v) for k, v in schema.items()}
    if out.get("type") == "object" and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def validate(params: StructuredOutputsParams) -> None:
    """Check a constraint compiles (no tokenizer needed): ValueError naming the field."""
    from llguidance import LLMatcher

    text = grammar_text(params)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(text)
    if is_error:
        message = messages[0] if messages else "invalid grammar"
        raise ValueError(f"StructuredOutputsParams.{params.kind} is invalid: {message}")


_LL_TOKENIZERS: dict[tuple, tuple[Any, Any]] = {}


def make_ll_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> Any:
    """llguidance's view of a fast HF tokenizer, sized to the model's vocabulary (~1 s to
    build, so kept per tokenizer object for the process)."""
    import llguidance.hf

    key = (id(tokenizer), vocab_size, tuple(eos_token_ids))
    cached = _LL_TOKENIZERS.get(key)
    if cached is None or cached[0] is not tokenizer:
        ll_tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None
        )
        cached = _LL_TOKENIZERS[key] = (tokenizer, ll_tokenizer)
    return cached[1]


class GrammarCompiler:
    """Compiles constraints to matchers (thread-safe), keeping one template per spec.

    ``matcher`` is called from the manager's thread pool: a spec compiles once (a second
    thread asking for it meanwhile waits for that compile), later requests copy it.
    """

    def __init__(self, ll_tokenizer: Any) -> None:
        self.ll_tokenizer = ll_tokenizer
        self._lock = threading.Lock()
        self._templates: OrderedDict[str, Any] = OrderedDict()
        self._compiling: dict[str, threading.Event] = {}
        self.num_compiled = 0
        self.num_cache_hits = 0

    def matcher(self, params: StructuredOutputsParams) -> Any:
        """A fresh matcher at the start of this constraint; ValueError if it is invalid."""
        from llguidance import LLMatcher

        key = params.cache_key()
        while True:
            with self._lock:
                template = self._templates.get(key)
                if template is not None:
                    self._templates.move_to_end(key)
                    self.num_cache_hits += 1
                    return template.deep_copy()
                busy = self._compiling.get(key)
                if busy is None:
                    self._compiling[key] = threading.Event()
                    break
            busy.wait()  # another thread compiles this spec; then take its template
        try:
            matcher = LLMatcher(self.ll_tokenizer, grammar_text(params), log_level=0)
            if matcher.is_error():
                raise ValueError(
                    f"StructuredOutputsParams.{params.kind} is invalid: {matcher.get_error()}"
                )
            with self._lock:
                self._templates[key] = matcher
                self.num_compiled += 1
                while len(self._templates) > GRAMMAR_CACHE_SIZE:
                    self._templates.popitem(last=False)
            return matcher.deep_copy()
        finally:
            with self._lock:
                self._compiling.pop(key).set()

    def clear(self) -> None:
        """Forget compiled grammars (the benchmark measures cold compiles with this)."""
        with self._lock:
            self._templates.clear()
