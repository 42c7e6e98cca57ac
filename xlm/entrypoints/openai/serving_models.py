"""GET /v1/models, POST /tokenize and POST /detokenize."""

from __future__ import annotations

from xlm.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    ModelPermission,
    TokenizeRequest,
    TokenizeResponse,
)
from xlm.entrypoints.openai.serving_chat import normalize_messages
from xlm.entrypoints.openai.serving_engine import OpenAIError, ServingContext
from xlm.tokenizer import apply_chat_template


class OpenAIServingModels:
    """Model listing and tokenizer endpoints."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    def show_available_models(self) -> ModelList:
        """Every served name, all pointing at the same model.

        `root` is the first served name, never the model's path: a local path says more
        about the host than a client needs to know.
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
        return ModelList(data=cards)

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
            self.ctx.check_token_ids(request.tokens)
        return DetokenizeResponse(prompt=self.ctx.engine.get_tokenizer().decode(request.tokens))
