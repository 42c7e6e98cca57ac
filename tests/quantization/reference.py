"""The float32 reference of a quantized engine: transformers on the same checkpoint with
each projection xlm quantizes replaced by its dequantized weight (xlm.quantization's numpy
rules; int4 in its groups at TP=1), and for w8a8 each projection's input rounded to int8
per token first."""

from __future__ import annotations

import numpy as np

from xlm.quantization import (
    dequantize,
    get_scheme,
    int4_group_size,
    quantize,
    quantize_activations,
)

# The HF modules xlm builds as `Linear` projections (MoE routers and experts, embeddings
# and the LM head stay in float).
PROJECTIONS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "qkv_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "gate_up_proj",
    "c_attn",
    "c_proj",
    "c_fc",
    "fc1",
    "fc2",
    "out_proj",
)


def quantize_hf_model(model, scheme_name: str) -> int:
    """Apply `scheme_name` to `model`'s projections in place; returns how many."""
    import torch

    scheme = get_scheme(scheme_name)
    count = 0
    for name, module in model.named_modules():
        if name.rpartition(".")[2] not in PROJECTIONS or not hasattr(module, "weight"):
            continue
        w = module.weight.detach().numpy()
        # nn.Linear holds [out, in]; GPT-2's Conv1D already [in, out] like xlm's kernel.
        conv1d = type(module).__name__ == "Conv1D"
        kernel = w if conv1d else w.T
        group = int4_group_size(kernel.shape[0]) if scheme.packed else None
        deq = dequantize(*quantize(kernel, scheme, group), scheme)
        with torch.no_grad():
            module.weight.copy_(torch.from_numpy(deq if conv1d else deq.T.copy()))
        if scheme.activations == "int8":
            module.register_forward_pre_hook(_fake_quantize_input)
        count += 1
    return count


def _fake_quantize_input(module, args):
    import torch

    (x,) = args
    q, s = quantize_activations(x.detach().reshape(-1, x.shape[-1]).numpy())
    return (torch.from_numpy((q.astype(np.float32) * s).reshape(x.shape)),)
