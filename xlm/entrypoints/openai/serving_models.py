"""GET /v1/models, LoRA adapters by name (and their loading at run time), POST /tokenize
and POST /detokenize."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from http import HTTPStatus

from xlm.engine.exceptions import EngineDeadError
from xlm.entrypoints.openai.cli_args import LoRAModulePath
from xlm.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    ModelPermission,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
)
from xlm.entrypoints.openai.serving_chat import normalize_messages
from xlm.entrypoints.openai.serving_engine import OpenAIError, ServingContext
from xlm.logger import init_logger
from xlm.lora.request import LoRARequest
from xlm.tokenizer import apply_chat_template

logger = init_logger(__name__)


class OpenAIServingModels:
    """The served names and LoRA adapters, and the tokenizer endpoints.

    Adapters live in `ctx.lora_requests` (name -> LoRARequest), where every handler's
    `check_model` finds them. Their ids only grow: an unloaded adapter's id is never given
    to another, so the engine's slots and prefix cache (keyed by id) cannot mix them.
    """

    def __init__(
        self,
        ctx: ServingContext,
        lora_modules: Sequence[LoRAModulePath] = (),
        lora_root: str | None = None,
    ) -> None:
        self.ctx = ctx
        self.lora_root = None if lora_root is None else os.path.realpath(lora_root)
        self._parents: dict[str, str] = {}  # adapter name -> the served name it adapts
        self._next_lora_id = 1
        self._lock = asyncio.Lock()  # one load or unload at a time
        for module in lora_modules:
            lora = LoRARequest(module.name, self._take_id(), os.path.abspath(module.path))
            self._add(lora, module.base_model_name or ctx.model_name)

    def _take_id(self) -> int:
        lora_id, self._next_lora_id = self._next_lora_id, self._next_lora_id + 1
        return lora_id

    def _add(self, lora: LoRARequest, parent: str) -> None:
        self.ctx.lora_requests[lora.lora_name] = lora
        self._parents[lora.lora_name] = parent

    def show_available_models(self) -> ModelList:
        """Every served name, then every adapter (`parent`: its base model).

        A served name's `root` is the first served name, never the model's path: a local
        path says more about the host than a client needs to know. An adapter's `root` is
        its directory, as vLLM lists it.
        """
        cards = [
            ModelCard(
                id=name,
                root=self.ctx.model_name,
                max_model_len=self.ctx.max_model_len,
                permission=[ModelPermission()],
            )
            for name in self.ctx.served_model_names
        ]
        cards += [
            ModelCard(
                id=name,
                root=lora.lora_path,
                parent=self._parents[name],
                max_model_len=self.ctx.max_model_len,
                permission=[ModelPermission()],
            )
            for name, lora in self.ctx.lora_requests.items()
        ]
        return ModelList(data=cards)

    async def check_lora_modules(self) -> None:
        """Read and check the --lora-modules adapters in the engine before serving
        (ValueError naming the first bad one)."""
        for lora in list(self.ctx.lora_requests.values()):
            try:
                await self.ctx.engine.add_lora(lora)
            except EngineDeadError:
                raise
            except RuntimeError as e:  # the engine's answer: the adapter's fault
                raise ValueError(
                    f"--lora-modules {lora.lora_name}={lora.lora_path}: {_reason(e)}"
                ) from None

    async def load_lora_adapter(self, request: LoadLoRAAdapterRequest) -> str:
        """Check a directory under --lora-root in the engine and serve it by name (400 for a
        taken name, a path outside the root or a bad adapter)."""
        name = request.lora_name
        async with self._lock:
            if name in self.ctx.served_model_names or name in self.ctx.lora_requests:
                raise OpenAIError(
                    f"The LoRA adapter '{name}' has already been loaded (or is a served "
                    "model name)",
                    param="lora_name",
                )
            lora = LoRARequest(name, self._take_id(), self._resolve(request.lora_path))
            try:
                await self.ctx.engine.add_lora(lora)
            except EngineDeadError:
                raise
            except RuntimeError as e:
                raise OpenAIError(
                    f"Could not load LoRA adapter '{name}': {_reason(e)}", param="lora_path"
                ) from None
            self._add(lora, self.ctx.model_name)
        logger.info(
            "Loaded LoRA adapter %r (id %d) from %s", name, lora.lora_int_id, lora.lora_path
        )
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload_lora_adapter(self, request: UnloadLoRAAdapterRequest) -> str:
        """Stop serving an adapter by name (404 if unknown); requests running with it
        finish with it."""
        name = request.lora_name
        async with self._lock:
            lora = self.ctx.lora_requests.pop(name, None)
            if lora is None:
                raise OpenAIError(
                    f"The LoRA adapter '{name}' cannot be found.",
                    HTTPStatus.NOT_FOUND,
                    "NotFoundError",
                    param="lora_name",
                    code="model_not_found",
                )
            del self._parents[name]
            await self.ctx.engine.remove_lora(lora.lora_int_id)
        logger.info("Unloaded LoRA adapter %r (id %d)", name, lora.lora_int_id)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _resolve(self, lora_path: str) -> str:
        """The real directory of a lora_path (relative: under --lora-root); 400 unless it
        and every entry in it resolve inside --lora-root."""
        root = self.lora_root
        if root is None:
            raise OpenAIError("Loading LoRA adapters at run time needs --lora-root")
        path = os.path.realpath(os.path.join(root, lora_path))
        if not _inside(path, root):
            raise OpenAIError(
                f"lora_path {lora_path!r} is outside the server's --lora-root", param="lora_path"
            )
        if not os.path.isdir(path):
            raise OpenAIError(
                f"lora_path {lora_path!r}: no such adapter directory", param="lora_path"
            )
        try:
            entries = sorted(os.listdir(path))
        except OSError as e:
            raise OpenAIError(
                f"lora_path {lora_path!r} cannot be read ({e.strerror})", param="lora_path"
            ) from None
        for entry in entries:  # the engine reads the files in it
            if not _inside(os.path.realpath(os.path.join(path, entry)), root):
                raise OpenAIError(
                    f"lora_path {lora_path!r}: {entry} links outside the server's --lora-root",
                    param="lora_path",
                )
        return path

    def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        """Token ids of a prompt or of templated chat messages."""
        self.ctx.check_model(request.model)
        tokenizer = self.ctx.engine.get_tokenizer()
        if request.messages is not None:
            try:
                ids = apply_chat_template(
                    tokenizer,
                    normalize_messages(request.messages),
                    add_generation_prompt=request.add_generation_prompt,
                )
            except OpenAIError:
                raise
            except Exception as e:
                raise OpenAIError(f"Could not apply the chat template: {e}") from e
        else:
            ids = list(
                tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
            )
        strs = tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return TokenizeResponse(
            count=len(ids), max_model_len=self.ctx.max_model_len, tokens=ids, token_strs=strs
        )

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        """Text of token ids (400 for ids outside the vocabulary)."""
        self.ctx.check_model(request.model)
        if request.tokens:
            self.ctx.engine.processor.check_token_ids(request.tokens)
        return DetokenizeResponse(prompt=self.ctx.engine.get_tokenizer().decode(request.tokens))


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def _reason(error: BaseException) -> str:
    """An engine utility's error text without the adapter error's class name."""
    return str(error).removeprefix("LoRAAdapterError: ")
