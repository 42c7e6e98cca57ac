"""Incremental detokenization and stop-string matching for one completion.

Text is grown with vLLM's prefix/read-offset technique: decode a small window of tokens
twice (without and with the new tokens) and emit the difference, holding text back while
it ends in U+FFFD (a multi-byte character split across tokens) so broken UTF-8 is never
emitted. Token pieces are joined like Hugging Face's slow tokenizers (and vLLM): runs of
ordinary tokens go through ``convert_tokens_to_string``; added/special tokens are kept
verbatim and, when ``spaces_between_special_tokens``, separated by a space.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

from xlm.sampling_params import SamplingParams

# How many prompt tokens give the first generated token its context (leading spaces).
_PROMPT_CONTEXT_TOKENS = 5


class TokenizerInfo:
    """Per-tokenizer lookups the detokenizers share (added vocab, special ids, pieces)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._decoded: dict[int, str] = {}

    @cached_property
    def added_tokens(self) -> frozenset[str]:
        return frozenset(self.tokenizer.get_added_vocab())

    @cached_property
    def special_ids(self) -> frozenset[int]:
        return frozenset(self.tokenizer.all_special_ids)

    def decode_token(self, token_id: int) -> str:
        """The text of one token alone (for logprobs), cached."""
        text = self._decoded.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id]) or ""
            self._decoded[token_id] = text
        return text

    def tokens_to_string(self, tokens: list[str], spaces_between_special_tokens: bool) -> str:
        """Join token pieces into text (see the module docstring)."""
        if not self.added_tokens:
            return self.tokenizer.convert_tokens_to_string(tokens) if tokens else ""
        sub_texts: list[str] = []
        run: list[str] = []
        for token in tokens:
            if token in self.added_tokens:
                if run:
                    sub_texts.append(self.tokenizer.convert_tokens_to_string(run))
                    run = []
                sub_texts.append(token)
            else:
                run.append(token)
        if run:
            sub_texts.append(self.tokenizer.convert_tokens_to_string(run))
        return (" " if spaces_between_special_tokens else "").join(sub_texts)

    def ids_to_tokens(self, token_ids: list[int], skip_special_tokens: bool) -> list[str]:
        """Token pieces of ``token_ids``, special tokens dropped when asked."""
        if skip_special_tokens:
            token_ids = [t for t in token_ids if t not in self.special_ids]
        return list(self.tokenizer.convert_ids_to_tokens(token_ids)) if token_ids else []

    def decode(self, token_ids: list[int], params: SamplingParams) -> str:
        """Whole-sequence text with the same joining rules as the incremental path."""
        tokens = self.ids_to_tokens(token_ids, params.skip_special_tokens)
        return self.tokens_to_string(tokens, params.spaces_between_special_tokens)


def check_stop_strings(
    output_text: str, new_char_count: int, stop: list[str], include_stop_str_in_output: bool
) -> tuple[str, int] | None:
    """The earliest stop string in the new text (or straddling into it) and where to cut."""
    best: tuple[str, int] | None = None
    for stop_str in stop:
        start = max(0, len(output_text) - new_char_count - len(stop_str) + 1)
        index = output_text.find(stop_str, start)
        if index != -1 and (best is None or index < best[1]):
            best = (stop_str, index)
    if best is None:
        return None
    stop_str, index = best
    return stop_str, index + len(stop_str) if include_stop_str_in_output else index


class IncrementalDetokenizer:
    """Text of one completion, grown token by token, with stop strings applied."""

    def __init__(
        self, info: TokenizerInfo | None, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self.info = info if params.detokenize else None
        self.params = params
        self.output_text = ""
        self.stop = list(params.stop or [])
        # Held back from outputs so a stop string split across steps is never sent in part.
        self.stop_buffer_length = (
            max(map(len, self.stop)) - 1
            if self.stop and not params.include_stop_str_in_output
            else 0
        )
        self._sent_offset = 0
        self.num_output_tokens = 0
        self.tokens: list[str] = []
        if self.info is not None:
            context = prompt_token_ids[-_PROMPT_CONTEXT_TOKENS - 1 :]
            self.tokens = self.info.ids_to_tokens(context, params.skip_special_tokens)
        self.read_offset = len(self.tokens)
        self.prefix_offset = max(self.read_offset - _PROMPT_CONTEXT_TOKENS, 0)

    def _text(self, tokens: list[str]) -> str:
        assert self.info is not None
        return self.info.tokens_to_string(tokens, self.params.spaces_between_special_tokens)

    def _decode_pending(self, flush: bool) -> str:
        prefix_text = self._text(self.tokens[self.prefix_offset : self.read_offset])
        new_text = self._text(self.tokens[self.prefix_offset :])
        if not flush and (len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd")):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        return new_text[len(prefix_text) :]

    def update(self, new_token_ids: list[int], stop_terminated: bool, finished: bool) -> str | None:
        """Add tokens; return the stop string that matched (text then trimmed), else None."""
        self.num_output_tokens += len(new_token_ids)
        if self.info is None:
            return None
        if stop_terminated and not self.params.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]  # the EOS / stop token's text is not output
        before = len(self.output_text)
        for token_id in new_token_ids:
            self.tokens.extend(self.info.ids_to_tokens([token_id], self.params.skip_special_tokens))
            self.output_text += self._decode_pending(flush=False)
        if finished and self.read_offset < len(self.tokens):
            # Genuinely invalid bytes at the end: emit them (as U+FFFD) rather than drop them.
            self.output_text += self._decode_pending(flush=True)
        # Like vLLM, stop strings count only once min_tokens tokens exist.
        if not self.stop or self.num_output_tokens <= self.params.min_tokens:
            return None
        match = check_stop_strings(
            self.output_text,
            len(self.output_text) - before,
            self.stop,
            self.params.include_stop_str_in_output,
        )
        if match is None:
            return None
        stop_str, cut = match
        self.output_text = self.output_text[:cut]
        return stop_str

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to send now: all of it, or only what is new (``delta``)."""
        length = len(self.output_text) - (0 if finished else self.stop_buffer_length)
        if not delta:
            return self.output_text[: max(length, 0)]
        if length <= self._sent_offset:
            return ""
        text = self.output_text[self._sent_offset : length]
        self._sent_offset = length
        return text
