"""xlm on Ray Data (the optional extra `xlm[ray]`): batch inference across a Ray cluster.

`build_llm_processor(ProcessorConfig(...))` turns a Ray Dataset of prompts into one of
generations, one xlm.LLM per Ray actor; `xlm run-batch --ray` runs OpenAI batch files
through it. Importing this package does not import ray; using it does.
"""

from xlm.ray.config import ProcessorConfig
from xlm.ray.processor import Processor, build_llm_processor

__all__ = ["Processor", "ProcessorConfig", "build_llm_processor"]
