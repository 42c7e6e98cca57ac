"""Op layers (CustomOp subclasses); importing this package registers them."""

from xlm.ops.activation import (
    Gelu,
    GeluAndMul,
    ReLU,
    SiluAndMul,
    get_act_and_mul_fn,
    get_act_fn,
)
from xlm.ops.custom_op import CustomOp
from xlm.ops.float_matmul import FloatMatmul
from xlm.ops.layernorm import LayerNorm, RMSNorm
from xlm.ops.lora import LoRA, token_slots
from xlm.ops.paged_attention import AttentionMetadata, PagedAttention
from xlm.ops.quant_matmul import QuantMatmul
from xlm.ops.rotary_embedding import RotaryEmbedding

__all__ = [
    "AttentionMetadata",
    "CustomOp",
    "FloatMatmul",
    "Gelu",
    "GeluAndMul",
    "LayerNorm",
    "LoRA",
    "PagedAttention",
    "QuantMatmul",
    "ReLU",
    "RMSNorm",
    "RotaryEmbedding",
    "SiluAndMul",
    "get_act_and_mul_fn",
    "get_act_fn",
    "token_slots",
]
