"""xlm.LLM: offline generation and chat over the engine."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from xlm import envs
from xlm.core.outputs import SchedulerStats
from xlm.engine.arg_utils import EngineArgs
from xlm.engine.llm_engine import LLMEngine
from xlm.engine.processor import check_pooling_task
from xlm.entrypoints import score_utils
from xlm.executor.multihost import follow_if_follower
from xlm.lora.request import LoRARequest
from xlm.multimodal.chat import extract_images, with_images
from xlm.outputs import PoolingRequestOutput, RequestOutput, ScoringOutput
from xlm.pooling_params import PoolingParams
from xlm.sampling_params import RequestOutputKind, SamplingParams
from xlm.tokenizer import apply_chat_template

PromptType = str | list[int] | dict[str, Any]


class LLM:
    """An engine for offline inference: `LLM(model).generate(prompts, params)`."""

    def __init__(
        self,
        model: str = "smollm2-135m",
        tokenizer: str | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = EngineArgs.max_num_seqs,
        max_num_batched_tokens: int = EngineArgs.max_num_batched_tokens,
        kv_cache_memory: float | None = None,
        enable_prefix_caching: bool = EngineArgs.enable_prefix_caching,
        seed: int = 0,
        load_format: str = "auto",
        multiprocess: bool = False,
        **kwargs: Any,
    ) -> None:
        known = {f.name for f in dataclasses.fields(EngineArgs)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(
                f"LLM() got unknown engine options {unknown}; known options: {sorted(known)}"
            )
        engine_args = EngineArgs(
            model=model,
            tokenizer=tokenizer,
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            kv_cache_memory=kv_cache_memory,
            enable_prefix_caching=enable_prefix_caching,
            seed=seed,
            load_format=load_format,
            **kwargs,
        )
        self._init_engine(engine_args, multiprocess)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, multiprocess: bool = False) -> LLM:
        """Build an LLM from an EngineArgs (the CLI's path)."""
        llm = cls.__new__(cls)
        llm._init_engine(engine_args, multiprocess)
        return llm

    def _init_engine(self, engine_args: EngineArgs, multiprocess: bool) -> None:
        # Under multihost, processes other than 0 follow process 0's engine here and
        # exit when it shuts down: the same script runs on every host.

        follow_if_follower(engine_args.create_parallel_config())
        if engine_args.startup_programs is None:
            # Offline work compiles the buckets its first step uses when it runs, the
            # rest in the background (a server readies its largest bucket first).
            engine_args = dataclasses.replace(engine_args, startup_programs="first-use")
        self.llm_engine = LLMEngine.from_engine_args(engine_args, multiprocess=multiprocess)
        self._request_counter = itertools.count()

    def wait_for_programs(self, timeout: float | None = None) -> bool:
        """Wait until every step program is compiled (they compile in the background from
        the first step on); whether they all are. From then on no step compiles."""
        return self.llm_engine.wait_for_programs(timeout)

    def get_stats(self) -> SchedulerStats:
        """The engine's counters now (xlm.core.outputs.SchedulerStats): running and
        waiting requests, KV cache and prefix cache use, preemptions, and speculative
        decoding's proposed and accepted tokens with its acceptance rate."""
        return self.llm_engine.get_stats()

    def get_tokenizer(self):
        """The tokenizer of the model (a transformers fast tokenizer)."""
        return self.llm_engine.get_tokenizer()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Complete each prompt (text, token ids, or {"prompt"/"prompt_token_ids": ...});
        `lora_request`: one adapter for all prompts or one (or None) per prompt (an engine
        with enable_lora=True)."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        loras = _as_lora_list(lora_request, len(prompt_list))
        return self._run(prompt_list, list(zip(params_list, loras)), use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations, formatted with the model's chat template.

        Content parts may carry images (a multimodal model): `image_url` (a data URL, or a
        file:// URL under allowed_local_media_path) and `image_pil` (a PIL image)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        processor = self.llm_engine.processor
        prompts = []
        for conversation in conversations:
            conversation, images = extract_images(
                conversation, processor.media_policy, processor.mm_processor is not None
            )
            ids = apply_chat_template(
                self.get_tokenizer(),
                conversation,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
            )
            prompts.append(with_images({"prompt_token_ids": ids}, images))
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[PoolingRequestOutput]:
        """One vector per prompt (`outputs.data`, float32 numpy; `outputs.embedding`, a
        list) from a pooling model (`runner="pooling"`); None pools the model's default way."""
        pooling = self.llm_engine.processor.pooling
        if pooling is not None:  # a classifier's requests are classify ones
            check_pooling_task("embed", pooling.labels is not None)
        return self._pool(prompts, pooling_params, use_tqdm, lora_request)

    def _pool(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None,
        use_tqdm: bool,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
    ) -> list[PoolingRequestOutput]:
        """Pool each prompt (embed, classify and score all run through here)."""
        prompt_list = _as_prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params_list = [pooling_params] * len(prompt_list)
        else:
            params_list = list(pooling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"pooling_params has {len(params_list)} entries but there are "
                    f"{len(prompt_list)} prompts: give one PoolingParams or one per prompt"
                )

        def add(request_id: str, prompt: PromptType, item: tuple) -> None:
            params, lora = item
            self.llm_engine.add_request(
                request_id, prompt, None, pooling_params=params, pooling=True, lora_request=lora
            )

        loras = _as_lora_list(lora_request, len(prompt_list))
        return self._run_requests(prompt_list, list(zip(params_list, loras)), add, use_tqdm)

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[PoolingRequestOutput]:
        """Label probabilities per prompt (`outputs.probs`: sigmoid of one label, softmax of
        several; `outputs.label`: the likeliest, from config.id2label) from a classifier
        (a *ForSequenceClassification checkpoint, or `convert="classify"`)."""
        labels = score_utils.check_classifier(self.llm_engine.processor.pooling)
        outputs = self._pool(prompts, PoolingParams(task="classify"), use_tqdm, lora_request)
        for out in outputs:
            out.outputs = score_utils.classification(out.outputs.data, labels)
        return outputs

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        use_tqdm: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> list[PoolingRequestOutput]:
        """One score per pair (`outputs.score`), pairs as vLLM makes them: 1-to-1, 1-to-N
        or N-to-N. A cross-encoder (single-label classifier) scores the pair encoded as
        `tokenizer(text_1, text_2)` (sigmoid of its logit); an embedding model scores the
        cosine of the two texts' embeddings (xlm.entrypoints.score_utils)."""
        pairs = score_utils.score_pairs(data_1, data_2)
        cross = score_utils.check_scoring_model(self.llm_engine.processor.pooling)
        ids, params = score_utils.score_inputs(self.get_tokenizer(), pairs, cross)
        prompts = [{"prompt_token_ids": i} for i in ids]
        pooled = self._pool(prompts, params, use_tqdm, lora_request)
        scores = score_utils.pair_scores([o.outputs.data for o in pooled], cross)
        tokens = score_utils.score_token_ids(ids, cross)
        return [
            PoolingRequestOutput(out.request_id, None, t, ScoringOutput(s))
            for out, t, s in zip(pooled, tokens, scores)
        ]

    # ---- LoRA adapters (enable_lora=True) -------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter now (requests naming it also load it on first use)."""
        return self.llm_engine.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.llm_engine.remove_lora(lora_id)

    def list_loras(self) -> list[int]:
        return self.llm_engine.list_loras()

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    # ---- sleep mode (enable_sleep_mode=True) and weight updates ---------------------------
    def sleep(self, level: int = 1) -> dict[str, int]:
        """Free device memory while idle: level 1 moves the weights to host memory and
        drops the KV cache, level 2 drops both (the weights are read again from their files
        on wake_up). Returns the device bytes freed ({"weights", "kv_cache"}); generating
        while asleep raises. Nothing is recompiled on wake-up."""
        return self.llm_engine.sleep(level)

    def wake_up(self) -> None:
        """Bring the weights and an empty KV cache back (awake already: nothing happens)."""
        self.llm_engine.wake_up()

    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping()

    def update_weights(self, path: str) -> None:
        """Load new weights from a checkpoint directory (or GGUF file) of the same model
        shapes, e.g. after an RL training step; a tensor whose shape or dtype differs raises
        ValueError naming it, and nothing changes. The prefix cache is dropped."""
        self.llm_engine.update_weights(path)

    def _run(
        self,
        prompts: list[PromptType],
        params: list[tuple[SamplingParams, LoRARequest | None]],
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        def add(request_id: str, prompt: PromptType, item: tuple) -> None:
            p, lora = item
            p = p.clone()
            p.output_kind = RequestOutputKind.FINAL_ONLY
            self.llm_engine.add_request(request_id, prompt, p, lora_request=lora)

        return self._run_requests(prompts, params, add, use_tqdm)

    def _run_requests(
        self, prompts: list[PromptType], params: list[Any], add: Any, use_tqdm: bool
    ) -> list[Any]:
        """Add every request (`add(request_id, prompt, params)`), step until all finish."""
        engine = self.llm_engine
        request_ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                request_id = str(next(self._request_counter))
                add(request_id, prompt, p)
                request_ids.append(request_id)
        except Exception:
            engine.abort_request(request_ids)  # nothing half-added stays in the engine
            raise
        finished: dict[str, Any] = {}
        bar = tqdm(
            total=len(request_ids),
            desc="Processed prompts",
            unit="prompt",
            disable=not use_tqdm or envs.XLM_DISABLE_PROGRESS_BARS,
        )
        num_generated = 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
                    if isinstance(output, RequestOutput):
                        num_generated += sum(len(c.token_ids) for c in output.outputs)
                    bar.update(1)
                    bar.set_postfix_str(f"{num_generated} tokens out", refresh=False)
        bar.close()
        return [finished[r] for r in request_ids]


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, str | dict):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    if not prompts:
        raise ValueError("prompts must not be empty")
    return prompts


def _as_params_list(params: Any, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(
            f"sampling_params has {len(params)} entries but there are {n} "
            f"prompts: give one SamplingParams or one per prompt"
        )
    return params


def _as_lora_list(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, n: int
) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    loras = list(lora_request)
    if len(loras) != n:
        raise ValueError(
            f"lora_request has {len(loras)} entries but there are {n} prompts: give one "
            "LoRARequest or one (or None) per prompt"
        )
    return loras
