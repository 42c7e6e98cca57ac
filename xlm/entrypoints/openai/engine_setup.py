"""Engine construction shared by the entry points: `build_engine` and `ServerState`.

The server (`api_server`), the local batch runner (`run_batch`) and the Ray batch
replicas (`xlm.ray.batch`) all start an engine from parsed flags and answer requests with
the same handlers; they import both from here, so none of them imports another.
"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prometheus_client import CollectorRegistry

from xlm.engine.arg_utils import EngineArgs
from xlm.engine.async_llm import AsyncLLM
from xlm.entrypoints.openai.admission import AdmissionGate, default_max_waiting
from xlm.entrypoints.openai.cli_args import create_engine_config
from xlm.entrypoints.openai.limits import DEFAULT_MAX_N, RequestLimits
from xlm.entrypoints.openai.serving_chat import OpenAIServingChat
from xlm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from xlm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from xlm.entrypoints.openai.serving_engine import ServingContext
from xlm.entrypoints.openai.serving_messages import AnthropicServingMessages
from xlm.entrypoints.openai.serving_models import OpenAIServingModels
from xlm.entrypoints.openai.serving_responses import OpenAIServingResponses
from xlm.entrypoints.openai.serving_score import OpenAIServingScore
from xlm.metrics.loggers import LoggingStatLogger, PrometheusStatLogger


def build_engine(
    args: argparse.Namespace, config: Any = None, engine_process: Any = None
) -> tuple[Any, Any]:
    """Start the engine process for the parsed flags; returns (AsyncLLM, metrics registry).

    `config` and `engine_process`: the config and the engine process `xlm serve` started
    before importing the server (`xlm.entrypoints.serve`); this waits for that process."""
    config = config or create_engine_config(args)
    registry = CollectorRegistry()
    name = (args.served_model_name or [args.model])[0]
    ranks = range(config.parallel_config.data_parallel_size)
    stat_loggers = [PrometheusStatLogger(name, registry, engine_indexes=ranks)]
    if not args.disable_log_stats:
        stat_loggers.append(LoggingStatLogger())
    engine = AsyncLLM.from_config(
        config,
        stat_loggers=stat_loggers,
        max_logprobs=args.max_logprobs,
        engine_process=engine_process,
    )
    return engine, registry


class ServerState:
    """Per-app state: the engine, the handlers, metrics, and whether we are draining."""

    def __init__(self, args: argparse.Namespace, engine: Any, registry: Any) -> None:
        self.args = args
        self.engine = engine
        self.registry = registry
        names = list(args.served_model_name or [args.model])
        ready = getattr(engine, "ready_info", None) or {}
        kv_cache_tokens = None
        block_size = getattr(getattr(engine, "xlm_config", None), "cache_config", None)
        if ready.get("kv_cache_tokens"):
            kv_cache_tokens = int(ready["kv_cache_tokens"])
        elif ready.get("num_blocks") and block_size is not None:
            # Block 0 is the null block; the rest hold tokens.
            kv_cache_tokens = (int(ready["num_blocks"]) - 1) * block_size.block_size
        self.ctx = ServingContext(
            engine=engine,
            served_model_names=names,
            max_model_len=engine.max_model_len,
            enable_log_requests=args.enable_log_requests,
            kv_cache_tokens=kv_cache_tokens,
            limits=RequestLimits(max_n=getattr(args, "max_n", DEFAULT_MAX_N)),
            trust_request_chat_template=getattr(args, "trust_request_chat_template", False),
            executor=ThreadPoolExecutor(max_workers=2, thread_name_prefix="xlm-tokenize"),
        )
        chat_template = _load_chat_template(args.chat_template)
        self.completion = OpenAIServingCompletion(self.ctx)
        self.chat = OpenAIServingChat(
            self.ctx,
            chat_template,
            reasoning_parser=getattr(args, "reasoning_parser", None),
            tool_call_parser=getattr(args, "tool_call_parser", None),
            enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
        )
        self.messages = AnthropicServingMessages(self.chat)
        self.models = OpenAIServingModels(
            self.ctx, getattr(args, "lora_modules", None) or (), getattr(args, "lora_root", None)
        )
        self.embedding = OpenAIServingEmbedding(self.ctx)
        self.score = OpenAIServingScore(self.ctx)
        self.responses = OpenAIServingResponses.from_args(self.chat, args)
        max_num_seqs = int(getattr(args, "max_num_seqs", None) or EngineArgs.max_num_seqs)
        max_waiting = getattr(args, "max_waiting_requests", None)
        if max_waiting is None:
            max_waiting = default_max_waiting(max_num_seqs)
        self.admission = AdmissionGate(max_num_seqs, max_waiting, registry)
        self.draining = False


def _load_chat_template(value: str | None) -> str | None:
    if value is None:
        return None
    try:
        with open(value) as f:
            return f.read()
    except OSError:
        return value
