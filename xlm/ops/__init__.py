"""Op layers (CustomOp subclasses); importing this package registers them."""

from xlm.ops.activation import SiluAndMul
from xlm.ops.custom_op import CustomOp
from xlm.ops.layernorm import RMSNorm
from xlm.ops.paged_attention import AttentionMetadata, PagedAttention
from xlm.ops.rotary_embedding import RotaryEmbedding

__all__ = [
    "AttentionMetadata",
    "CustomOp",
    "PagedAttention",
    "RMSNorm",
    "RotaryEmbedding",
    "SiluAndMul",
]
