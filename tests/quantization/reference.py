"""The float32 reference of a quantized engine: transformers on the same checkpoint with
each projection xlm quantizes replaced by its dequantized weight (xlm.quantization's numpy
rules; int4 in its groups at TP=1; int8 on CPU in Q8_0's blocks of 32), and for w8a8 each
projection's input rounded to int8 per token first."""

from __future__ import annotations

import dataclasses

import numpy as np

from xlm.quantization import (
    dequantize,
    get_scheme,
    quantize,
    quantize_activations,
    weight_groups,
)

# The HF modules xlm builds as `Linear` projections (MoE routers and experts stay in float).
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
    """Apply `scheme_name` to `model`'s projections in place (and, for schemes that store
    them in 8 bits, its embedding table and LM head: per vocabulary row, tied ones once);
    returns how many."""
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
        groups = engine_groups(kernel.shape[0], scheme)
        deq = _round_trip(kernel, scheme, groups)
        with torch.no_grad():
            module.weight.copy_(torch.from_numpy(deq if conv1d else deq.T.copy()))
        quantize_inputs(module, scheme, groups)
        count += 1
    if scheme.embeddings:
        tables = [model.get_input_embeddings(), model.get_output_embeddings()]
        for table in {id(t): t for t in tables if t is not None}.values():
            w = table.weight.detach().numpy()  # [vocab, hidden]: a kernel [hidden, vocab]
            groups = engine_groups(w.shape[1], scheme)
            with torch.no_grad():
                table.weight.copy_(torch.from_numpy(_round_trip(w.T, scheme, groups).T.copy()))
            count += 1
        if model.get_output_embeddings() is not None:
            quantize_inputs(model.get_output_embeddings(), scheme, groups)
    return count


def engine_groups(in_features: int, scheme) -> int:
    """The scales along the input a single-device engine on this machine gives a kernel
    of `in_features` inputs: on CPU a `cpu_group_size` scheme (int8) takes its blocks;
    else the scheme's own groups."""
    import jax

    if scheme.cpu_group_size and jax.default_backend() == "cpu":
        scheme = dataclasses.replace(scheme, group_size=scheme.cpu_group_size)
    return weight_groups(in_features, scheme)


def _round_trip(kernel: np.ndarray, scheme, groups: int) -> np.ndarray:
    group = kernel.shape[0] // groups
    return dequantize(*quantize(kernel, scheme, group), scheme)


def quantize_inputs(module, scheme, groups: int) -> None:
    """w8a8: the module's input rounded to int8 first, a scale per token and weight group."""
    if scheme.activations != "int8":
        return

    def hook(module, args):
        import torch

        (x,) = args
        q, s = quantize_activations(x.detach().reshape(-1, x.shape[-1]).numpy(), groups)
        deq = q.astype(np.float32).reshape(q.shape[0], groups, -1) * s[:, :, None]
        return (torch.from_numpy(deq.reshape(x.shape)),)

    module.register_forward_pre_hook(hook)
