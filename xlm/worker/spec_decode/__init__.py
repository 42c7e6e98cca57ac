"""Speculative decoding on the worker side: proposers, their policy and the per-step pass.

After a step's tokens are known, the runner asks the proposer for each decoding request's
next tokens (``ModelRunnerOutput.spec_token_ids``); the scheduler schedules them after the
request's last token (``SchedulerOutput.scheduled_spec_decode_tokens``), the model step
computes them like known tokens, and the sampler verifies them
(``xlm.worker.sampler._verify_random``; greedy rows compare with the argmax).

A proposer is anything with ``propose_batch(batch, wanted) -> {req_id: tokens}`` over the
runner's persistent batch: ``NgramProposer`` is prompt lookup, one request at a time on
the host; ``DraftModelProposer`` runs a smaller model greedily on the device, all
requests together, on a KV cache of its own. EAGLE-style heads, which read the target's
hidden states, would take the same seam with the step's hidden states added.
"""

from xlm.worker.spec_decode.batch import Speculator, propose_for_batch
from xlm.worker.spec_decode.draft import DraftModelProposer
from xlm.worker.spec_decode.policy import SpeculationPolicy, may_speculate
from xlm.worker.spec_decode.proposers import NgramProposer, Proposer, make_ngram_proposer

__all__ = [
    "DraftModelProposer",
    "NgramProposer",
    "Proposer",
    "SpeculationPolicy",
    "Speculator",
    "make_ngram_proposer",
    "may_speculate",
    "propose_for_batch",
]
