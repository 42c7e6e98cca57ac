"""A byte-level BPE trained in milliseconds on a little text: every string has a spelling,
and characters outside the training text split into several byte tokens."""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast


def train_byte_level_bpe(
    text: str, vocab_size: int, special_tokens: list[str], **tokenizer_kwargs
) -> PreTrainedTokenizerFast:
    """A fast tokenizer trained on `text` (special tokens first in the vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([text] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, **tokenizer_kwargs)


def hello_tokenizer() -> PreTrainedTokenizerFast:
    """The detokenizer tests' tokenizer: ASCII words and stop words, <s> and </s>."""
    return train_byte_level_bpe(
        "Hello world, hello words. The stop word is here.",
        320,
        ["<s>", "</s>"],
        bos_token="<s>",
        eos_token="</s>",
    )
