"""Structured outputs: JSON schemas, regexes, choices and grammars through llguidance.

``StructuredOutputsParams`` is the constraint a request carries (``SamplingParams.
structured_outputs``); ``backend`` compiles it against the tokenizer; ``manager`` keeps
each request's matcher in step with the sampled tokens and builds the step's bitmask.
llguidance is imported only when a constraint is used.
"""

from xlm.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
