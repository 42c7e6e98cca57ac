"""LoRARequest: which adapter a request runs with (vLLM's fields and order)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter by name, a positive integer id unique per adapter, and its directory.

    Two requests with the same ``lora_int_id`` use the same adapter; the engine loads it
    from ``lora_path`` the first time the id is seen (and again if it was evicted).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(
                f"LoRARequest.lora_name={self.lora_name!r} is invalid: allowed a non-empty string"
            )
        lid = self.lora_int_id
        if not isinstance(lid, int) or isinstance(lid, bool) or lid < 1:
            raise ValueError(
                f"LoRARequest.lora_int_id={lid!r} is invalid: allowed a positive integer "
                "(0 is the base model)"
            )
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(
                f"LoRARequest.lora_path={self.lora_path!r} is invalid: allowed the adapter's "
                "directory"
            )

    @property
    def cache_key(self) -> tuple[str, int, str]:
        """What keys a request's prefix-cache blocks: two adapters never share K/V."""
        return ("lora", self.lora_int_id, self.lora_name)
