"""One step's sampled tokens applied to a request: appended up to the first that stops it."""

from __future__ import annotations

from typing import Any

from xlm.core.request import Request, RequestStatus
from xlm.logger import init_logger

logger = init_logger(__name__)

_STOPPED = RequestStatus.FINISHED_STOPPED
_LENGTH_CAPPED = RequestStatus.FINISHED_LENGTH_CAPPED
_ERROR = RequestStatus.FINISHED_ERROR


def append_sampled_tokens(
    request: Request, token_ids: list[int], max_len: int, structured_output_manager: Any
) -> tuple[list[int], bool]:
    """Append the tokens up to the first that stops the request, then advance its grammar
    over them: (tokens kept, stopped); a stopped request's status says why."""
    new_token_ids, stopped = append_tokens(request, token_ids, max_len)
    if not stopped:
        stopped = advance_grammar(structured_output_manager, request, new_token_ids)
    return new_token_ids, stopped


def append_tokens(request: Request, token_ids: list[int], max_len: int) -> tuple[list[int], bool]:
    """Append sampled tokens up to the first that stops the request: (kept, stopped)."""
    if len(token_ids) == 1:
        token_id = token_ids[0]
        request.output_token_ids.append(token_id)
        request.all_token_ids.append(token_id)
        return token_ids, check_stop(request, token_id, max_len)
    for n, token_id in enumerate(token_ids, 1):
        request.output_token_ids.append(token_id)
        request.all_token_ids.append(token_id)
        if check_stop(request, token_id, max_len):
            return token_ids[:n], True
    return token_ids, False


def advance_grammar(structured_output_manager: Any, request: Request, token_ids: list[int]) -> bool:
    """Advance a constrained request's matcher; whether its grammar ended it."""
    constraint = request.structured_output_request
    if constraint is None or constraint.matcher is None:
        return False
    # The grammar is complete ("stop") or, should it ever happen, refused the token:
    # that ends this request with an error, never the engine.
    verdict = structured_output_manager.advance(constraint, token_ids)
    if verdict == "stop":
        request.status = _STOPPED
        return True
    if verdict is not None:
        logger.error("Request %s: %s", request.request_id, verdict)
        request.status = _ERROR
        request.stop_reason = verdict
        return True
    return False


def check_stop(request: Request, token_id: int, max_len: int) -> bool:
    """Apply stop conditions after token_id was appended; set the status if stopped."""
    num_output = len(request.output_token_ids)
    if num_output >= request.min_tokens:
        if token_id == request.eos_token_id and not request.ignore_eos:
            request.status = _STOPPED
            return True
        if token_id in request.stop_token_ids:
            request.status = _STOPPED
            request.stop_reason = token_id
            return True
    max_tokens = request.max_tokens
    if (max_tokens is not None and num_output >= max_tokens) or len(
        request.all_token_ids
    ) >= max_len:
        request.status = _LENGTH_CAPPED
        return True
    return False


def roll_back_rejected(request: Request, num_proposed: int, num_tokens: int) -> int:
    """A verified request kept num_tokens - 1 proposals and one token of its own: the
    K/V computed for the rejected proposals does not count (their slots are written
    again by the next step; their blocks were never entered in the prefix cache, which
    takes only blocks of known tokens). Returns the number of accepted proposals."""
    num_accepted = num_tokens - 1
    request.num_computed_tokens -= num_proposed - num_accepted
    return num_accepted
