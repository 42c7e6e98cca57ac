"""What one Scheduler.schedule() call has decided so far, passed between its phases."""

from __future__ import annotations

from dataclasses import dataclass, field

from xlm.core.kv_cache_manager import BlockIds
from xlm.core.outputs import CachedRequestData, NewRequestData
from xlm.core.request import Request


@dataclass(frozen=True)
class ImageRule:
    """How one step may cover a multimodal request's images: at most `cap` distinct
    images (the runner's encoder cache slots) and, with `whole` (images attended both
    ways, Gemma 3), no part of an image without the rest."""

    cap: int
    whole: bool = False


@dataclass(slots=True)
class StepPlan:
    """One step's scheduled requests and token counts, filled phase by phase."""

    token_budget: int
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    cached: CachedRequestData = field(default_factory=CachedRequestData)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    preempted_req_ids: set[str] = field(default_factory=set)
    scheduled: list[Request] = field(default_factory=list)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Content hashes of the images whose placeholders the step covers (encoder budget).
    images: set[str] = field(default_factory=set)

    def fit_images(self, request: Request, start: int, num_new: int, rule: ImageRule | None) -> int:
        """`num_new` tokens from `start`, cut before the first image that would make the
        step cover more than `rule.cap` distinct images or, with `rule.whole`, before an
        image the chunk would end inside (None: a text model, no cut); the images kept are
        counted to the step."""
        if rule is None:
            return num_new
        stop = start + num_new
        for feature in request.mm_features or ():
            if not feature.overlaps(start, stop):
                continue
            if (rule.whole and feature.end > stop) or (
                feature.identifier not in self.images and len(self.images) >= rule.cap
            ):
                return max(feature.offset - start, 0)
            self.images.add(feature.identifier)
        return num_new

    def add_cached(
        self, req_id: str, resumed: bool, block_ids: BlockIds, num_computed: int, tokens: list[int]
    ) -> None:
        """Schedule a request the runner has seen (running, or resumed from preemption)."""
        cached = self.cached
        cached.req_ids.append(req_id)
        cached.resumed_from_preemption.append(resumed)
        cached.new_block_ids.append(block_ids)
        cached.num_computed_tokens.append(num_computed)
        cached.new_token_ids.append(tokens)


def trim_proposals(
    request: Request, spec: list[int], num_new: int, token_budget: int, max_request_len: int
) -> list[int]:
    """The proposals worth verifying: only after a request's last token (a decode step),
    within the step's budget, and no more than could still be output before max_tokens
    or the length cap `max_request_len` ends it (the step adds up to len(spec) + 1)."""
    if num_new != 1 or request.num_output_placeholders:
        return []
    room = min(token_budget - 1, max_request_len - len(request.all_token_ids) - 1)
    if request.max_tokens is not None:
        room = min(room, request.max_tokens - len(request.output_token_ids) - 1)
    return spec[: max(room, 0)]
