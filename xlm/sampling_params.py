"""SamplingParams: how to sample one request, validated on construction."""

from __future__ import annotations

import copy
import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

from xlm.structured_output.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5
# Logit bias entries travel to the device as a fixed-width padded list (see
# xlm.worker.sampler): this is its width, so it is also the per-request limit.
MAX_LOGIT_BIAS_TOKENS = 1024
# OpenAI clamps logit_bias values to this range; vLLM's server does the same.
LOGIT_BIAS_LIMIT = 100.0
# Width of the top-k logprobs the device returns per token (xlm.worker.sampler): no request
# can get more, so it also caps --max-logprobs.
MAX_DEVICE_LOGPROBS = 20
# Fields that a model's generation_config.json may provide defaults for
# (generation_config key -> SamplingParams field).
_GENERATION_CONFIG_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


class RequestOutputKind(enum.IntEnum):
    """What each RequestOutput carries: everything so far, only what is new, or the end."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingType(enum.IntEnum):
    """Greedy (argmax), random, or random with a per-request seed."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _invalid(name: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"SamplingParams.{name}={value!r} is invalid: allowed {allowed}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(init=False)
class SamplingParams:
    """Sampling parameters of one request, with vLLM's names and defaults.

    Choices where vLLM leaves room: ``logprobs``/``prompt_logprobs`` must be >= 0
    (vLLM's -1 "whole vocabulary" is rejected: outputs have a fixed top-k width on
    device, and the engine checks the count against its ``max_logprobs``);
    ``logit_bias`` values are clamped to [-100, 100] like OpenAI, keys may be ints
    or numeric strings (JSON), at most ``MAX_LOGIT_BIAS_TOKENS`` entries.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # A constraint on the output (JSON schema, regex, choice, grammar): see xlm.structured_output.
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by the engine: EOS ids plus stop_token_ids (what min_tokens masks).
    all_stop_token_ids: set[int] = field(default_factory=set)
    # Filled by update_from_tokenizer: each bad word as token ids (two spellings).
    _bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)
    # Names of fields the caller passed explicitly (generation_config never overrides).
    _explicit_fields: frozenset[str] = field(default_factory=frozenset, repr=False)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Fields by position or name, as a dataclass takes them; remembers which were given.

        The fields passed explicitly (by position or name) are recorded in
        ``_explicit_fields``: the model's generation_config never overrides those.
        """
        names = [f.name for f in dataclasses.fields(self) if f.name != "_explicit_fields"]
        if len(args) > len(names):
            raise TypeError(f"SamplingParams takes at most {len(names)} positional arguments")
        given = dict(zip(names, args))
        for name, value in kwargs.items():
            if name in given:
                raise TypeError(f"SamplingParams got multiple values for argument {name!r}")
            given[name] = value
        unknown = set(given) - set(names) - {"_explicit_fields"}
        if unknown:
            raise TypeError(f"SamplingParams got an unexpected keyword argument {min(unknown)!r}")
        for f in dataclasses.fields(self):
            if f.name in given:
                value = given[f.name]
            elif f.default_factory is not dataclasses.MISSING:
                value = f.default_factory()
            else:
                value = f.default
            setattr(self, f.name, value)
        explicit = frozenset(given) - {"_explicit_fields"}
        self._explicit_fields = explicit | frozenset(self._explicit_fields)
        self.__post_init__()

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = list(self.bad_words or [])
        self.all_stop_token_ids = set(self.all_stop_token_ids)
        self.all_stop_token_ids.update(self.stop_token_ids)
        if self.logit_bias is not None:
            self.logit_bias = self._normalize_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if not isinstance(self.output_kind, RequestOutputKind):
            try:
                self.output_kind = RequestOutputKind(self.output_kind)
            except ValueError:
                raise _invalid("output_kind", self.output_kind, "a RequestOutputKind") from None
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if self.seed is not None and _is_int(self.seed):
            self.seed = int(self.seed)
        self._verify()

    @staticmethod
    def _normalize_logit_bias(bias: Any) -> dict[int, float]:
        if not isinstance(bias, dict):
            raise _invalid("logit_bias", bias, "a dict of token id -> bias")
        out: dict[int, float] = {}
        for key, value in bias.items():
            try:
                token_id = int(key)
            except (TypeError, ValueError):
                raise _invalid("logit_bias", bias, "integer token ids as keys") from None
            if not _is_number(value) or value != value:
                raise _invalid(f"logit_bias[{key!r}]", value, "a number")
            out[token_id] = max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(value)))
        return out

    def _verify(self, names: set[str] | None = None) -> None:
        """Check each field's rule (only those in `names` when given)."""

        def check(ok: bool, name: str, allowed: str) -> None:
            if not ok and (names is None or name in names):
                raise _invalid(name, getattr(self, name), allowed)

        check(_is_int(self.n) and self.n >= 1, "n", "an integer >= 1")
        check(_is_number(self.temperature) and self.temperature >= 0, "temperature", ">= 0")
        check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "(0, 1]")
        check(
            _is_int(self.top_k) and (self.top_k in (-1, 0) or self.top_k >= 1),
            "top_k",
            "-1 or 0 (disabled) or an integer >= 1",
        )
        check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "[0, 1]")
        check(self.seed is None or _is_int(self.seed), "seed", "None or an integer")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(_is_number(value) and -2 <= value <= 2, name, "[-2, 2]")
        check(
            _is_number(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            "> 0",
        )
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "non-empty strings")
        if names is None and self.stop and not self.detokenize:
            raise _invalid("stop", self.stop, "only with detokenize=True (stop strings need text)")
        check(
            all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "integers >= 0",
        )
        check(
            self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
            "max_tokens",
            "None or an integer >= 1",
        )
        check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "an integer >= 0")
        if names is None and self.max_tokens is not None:
            self.verify_min_tokens()
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(value is None or (_is_int(value) and value >= 0), name, "None or an integer >= 0")
        if self.logit_bias is not None:
            check(
                len(self.logit_bias) <= MAX_LOGIT_BIAS_TOKENS,
                "logit_bias",
                f"at most {MAX_LOGIT_BIAS_TOKENS} entries",
            )
            check(all(t >= 0 for t in self.logit_bias), "logit_bias", "token ids >= 0")
        if self.allowed_token_ids is not None:
            check(
                len(self.allowed_token_ids) > 0
                and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids),
                "allowed_token_ids",
                "None or a non-empty list of integers >= 0",
            )
        check(
            all(isinstance(w, str) and w for w in self.bad_words), "bad_words", "non-empty strings"
        )
        check(
            self.structured_outputs is None
            or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs",
            "None or a StructuredOutputsParams",
        )

    def verify_min_tokens(self) -> None:
        """min_tokens <= max_tokens (the engine checks it when it sets max_tokens)."""
        if self.min_tokens > self.max_tokens:
            raise _invalid("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")

    # -- properties ---------------------------------------------------------------------

    @property
    def sampling_type(self) -> SamplingType:
        """Greedy when temperature < 1e-5, else random (seeded when seed is set)."""
        if self.temperature < _GREEDY_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        """Token-id spellings of ``bad_words`` (after ``update_from_tokenizer``)."""
        return self._bad_words_token_ids

    def was_given(self, name: str) -> bool:
        """Whether the caller set field `name` (defaults never override a given value)."""
        return name in self._explicit_fields

    # -- engine-side updates ------------------------------------------------------------

    def update_from_generation_config(
        self, gen_cfg: dict[str, Any] | None, eos_token_ids: int | list[int] | None = None
    ) -> None:
        """Apply the model's generation_config defaults to fields the caller left unset."""
        gen_cfg = gen_cfg or {}
        applied = set()
        for key, name in _GENERATION_CONFIG_FIELDS.items():
            if name in self._explicit_fields or gen_cfg.get(key) is None:
                continue
            setattr(self, name, gen_cfg[key])
            applied.add(name)
        if applied:
            self._verify(applied)
        if not self.ignore_eos:
            ids: list[int] = []
            for source in (eos_token_ids, gen_cfg.get("eos_token_id")):
                if source is None:
                    continue
                ids.extend([source] if _is_int(source) else list(source))
            self.all_stop_token_ids.update(ids)

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """Tokenize ``bad_words`` (as-is and with a leading space, like vLLM)."""
        self._bad_words_token_ids = []
        for word in self.bad_words:
            plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if plain:
                self._bad_words_token_ids.append(plain)
            # The spaced spelling counts only when the space makes a distinct first token
            # and not an extra one (vLLM's rule).
            if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
                self._bad_words_token_ids.append(spaced)

    def verify_vocab(self, vocab_size: int) -> None:
        """Check token ids against the model vocabulary: each must lie in [0, vocab_size)."""
        allowed = f"token ids in [0, {vocab_size})"
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("logit_bias", list(self.logit_bias or {})),
            ("allowed_token_ids", self.allowed_token_ids or []),
        ):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(
                    f"SamplingParams.{name} has token id {bad[0]} out of range: allowed {allowed}"
                )

    # -- copies and serialization -------------------------------------------------------

    def clone(self) -> SamplingParams:
        """A deep copy (the engine mutates its copy)."""
        return copy.deepcopy(self)

    def to_dict(self) -> dict[str, Any]:
        """Plain msgpack-able dict (lists, ints, floats, strings)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "logit_bias" and value is not None:
                value = [[k, v] for k, v in value.items()]
            elif isinstance(value, set | frozenset):
                value = sorted(value)
            elif isinstance(value, RequestOutputKind):
                value = int(value)
            elif isinstance(value, StructuredOutputsParams):
                value = value.to_dict()
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        """Inverse of ``to_dict``: restores checked parameters without checking them again."""
        params = cls.__new__(cls)
        for f in dataclasses.fields(cls):
            setattr(params, f.name, data[f.name])
        if params.logit_bias is not None:
            params.logit_bias = {int(k): v for k, v in params.logit_bias}
        params.output_kind = RequestOutputKind(params.output_kind)
        if params.structured_outputs is not None:
            params.structured_outputs = StructuredOutputsParams.restore(params.structured_outputs)
        params.all_stop_token_ids = set(params.all_stop_token_ids)
        params._explicit_fields = frozenset(params._explicit_fields)
        params._bad_words_token_ids = [list(ids) for ids in params._bad_words_token_ids]
        return params


def uses_penalties(params: Any) -> bool:
    """Whether presence, frequency or repetition penalties apply: sampling then reads the
    counts of the request's output tokens (read by name: test doubles are duck-typed)."""
    return bool(
        getattr(params, "presence_penalty", 0)
        or getattr(params, "frequency_penalty", 0)
        or getattr(params, "repetition_penalty", 1.0) != 1.0
    )


def uses_output_bans(params: Any) -> bool:
    """Whether min_tokens or bad words ban tokens depending on the latest output tokens."""
    return bool(getattr(params, "min_tokens", 0) or getattr(params, "bad_words_token_ids", None))
