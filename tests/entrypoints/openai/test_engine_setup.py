"""The server's per-app state: served names, the KV cache's token count from what the
engine reported at start-up, the admission gate's size, a chat template from a file or
inline."""

from __future__ import annotations

import argparse

from tests.entrypoints.openai.fake_engine import FakeAsyncEngine
from xlm.entrypoints.openai.cli_args import finish_args, make_arg_parser
from xlm.entrypoints.openai.engine_setup import ServerState

MODEL = "/models/m"


def _state(tokenizer, *flags, ready=None):
    args = finish_args(make_arg_parser(argparse.ArgumentParser()), [MODEL, *flags])
    engine = FakeAsyncEngine(tokenizer, max_model_len=64)
    engine.ready_info = ready or {}
    return ServerState(args, engine, registry=None)


def test_names_kv_tokens_and_admission_follow_the_args_and_the_engine(tokenizer):
    state = _state(tokenizer, "--max-num-seqs", "3", ready={"kv_cache_tokens": 4096})
    assert state.ctx.served_model_names == [MODEL]
    assert state.ctx.kv_cache_tokens == 4096
    assert state.admission.max_num_seqs == 3
    named = _state(tokenizer, "--served-model-name", "a", "b")
    assert named.ctx.served_model_names == ["a", "b"] and named.ctx.kv_cache_tokens is None


def test_a_chat_template_is_read_from_its_file_or_taken_inline(tokenizer, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0].content }}!")
    assert _state(tokenizer, "--chat-template", str(path)).chat.chat_template == (
        "{{ messages[0].content }}!"
    )
    inline = "{{ messages | length }}"
    assert _state(tokenizer, "--chat-template", inline).chat.chat_template == inline
