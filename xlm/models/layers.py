"""Model building blocks: embedding, linear layers with sharding metadata, LM head, attention.

Parameters carry logical sharding metadata for tensor parallelism over the mesh axis
"model" (column-parallel kernels split their output dimension, row-parallel ones their
input dimension). The metadata is only attached (`eager_sharding=False`): building a
model needs no mesh, and the loader places each tensor with the sharding it names.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx

from xlm.config import (
    get_current_lora_config,
    get_current_quantization,
    get_current_weight_dtype,
)
from xlm.distributed.mesh import TP_AXIS
from xlm.distributed.tensor_parallel import check_split, kv_head_replicas, tp_size
from xlm.ops import (
    AttentionMetadata,
    FloatMatmul,
    LoRA,
    PagedAttention,
    QuantMatmul,
    RMSNorm,
    RotaryEmbedding,
    get_act_and_mul_fn,
)
from xlm.ops.lora import current_token_slots
from xlm.quantization import (
    Q8_STRIP_COLS,
    Q8_STRIP_ROWS,
    get_scheme,
    q8_strips_fit,
    weight_groups,
)

Parallel = Literal["column", "row"] | None

_KERNEL_SHARDING = {"column": (None, TP_AXIS), "row": (TP_AXIS, None), None: (None, None)}
# LoRA A [in, slots, Rt] splits its input like the kernel; B [slots, Rt, out] its output.
_LORA_A_SHARDING = {"column": (None, None, None), "row": (TP_AXIS, None, None), None: (None,) * 3}
_LORA_B_SHARDING = {"column": (None, None, TP_AXIS), "row": (None, None, None), None: (None,) * 3}


class WeightScale(nnx.Param):
    """A quantized kernel's scales or minimums [G, out] (xlm.quantization): read from a
    checkpoint that holds them, or made by the loader as it quantizes the kernel."""


class LoRAWeight(nnx.Param):
    """A LoRA slot array (xlm.ops.lora): zeros until an adapter is written into a slot;
    no checkpoint holds it (the loader places zeros)."""


def param(value: jax.Array, sharding: tuple[str | None, ...], **metadata: Any) -> nnx.Param:
    """An nnx.Param annotated with `sharding` names (and layout metadata), not sharded eagerly.

    Layout metadata (`head_replicas`, `fused_shards`) is described in
    xlm.distributed.tensor_parallel; the loader applies it.
    """
    return nnx.Param(value, out_sharding=sharding, eager_sharding=False, **metadata)


def unloaded(shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """A parameter's value before loading. Models are only built inside nnx.eval_shape
    (loader.build_abstract_model) and every value then comes from the checkpoint or the
    dummy format, so this only fixes shape and dtype: one traced op, where a random
    initializer traced a dozen per parameter (0.3 s of every start for SmolLM2)."""
    return jnp.zeros(shape, dtype)


def quantized_groups(
    quant: Any,
    scheme: Any,
    quant_layout: Any,
    in_features: int,
    out_features: int,
    shards: int = 1,
) -> tuple[int, bool]:
    """(G, in strips) of a quantized kernel [in, out]: how many scales along the input it
    has (xlm.quantization.weight_groups; made from float weights for the CPU kernel, a
    scheme's `cpu_group_size`, int8's Q8_0 blocks, takes the place of its `group_size`)
    and whether it is stored in the CPU kernel's strips: a scheme stored so (int8, w8a8)
    run by the CPU kernel, one device's whole kernel (no tensor-parallel split, under
    which the layout metadata moves nothing), and a shape the strips fit."""
    cpu = quant.runs_cpu_kernel()
    if cpu and quant_layout is None and scheme.cpu_group_size is not None:
        scheme = dataclasses.replace(scheme, group_size=scheme.cpu_group_size)
    groups = weight_groups(in_features, scheme, quant_layout, shards)
    strips = scheme.cpu_strips and cpu and tp_size() == 1
    return groups, strips and q8_strips_fit(in_features, out_features, groups)


def q8_strip_params(
    in_features: int, out_features: int, groups: int, scheme: Any, layout: dict[str, Any]
) -> tuple[nnx.Param, Any]:
    """(kernel, weight_scale) in the CPU kernel's strips (xlm.quantization.q8_kernel_strips),
    which the loader makes: [out / 32, in / 4, 32, 4] and [out / 32, G, 32], replicated."""
    cols = out_features // Q8_STRIP_COLS
    kernel = unloaded(
        (cols, in_features // Q8_STRIP_ROWS, Q8_STRIP_COLS, Q8_STRIP_ROWS), scheme.weight_dtype
    )
    scale = WeightScale(
        unloaded((cols, groups, Q8_STRIP_COLS), jnp.float32),
        out_sharding=(None,) * 3,
        eager_sharding=False,
        q8_strips=True,
        **layout,
    )
    return param(kernel, (None,) * 4, quantized=scheme.name, q8_strips=True, **layout), scale


class Linear(nnx.Module):
    """y = x @ kernel (+ bias), kernel [in, out]; column/row-parallel sharding metadata.

    A float kernel the CPU float kernel streams is stored [out, in] instead (`out_major`,
    FloatMatmul.prefers_out_major; one device's whole kernel), an int8 or w8a8 one in the
    CPU kernel's strips (`quantized_groups`): the loader makes both from the [in, out] weight."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = False,
        parallel: Parallel = None,
        dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
        layout: dict[str, Any] | None = None,
        lora: bool = True,
        quantize: bool = True,
    ) -> None:
        """`lora=False`: no adapter slots even when LoRA is on; `quantize=False`: float
        weights even under quantization (MoE routers, whose choice of experts is sensitive
        to rounding; OPT's embedding projections, as vLLM keeps them)."""
        self.in_features, self.out_features = in_features, out_features
        layout = layout or {}
        quantization, quant_layout = get_current_quantization() if quantize else (None, None)
        self.out_major = False
        if quantization is None:
            weight_dtype = (get_current_weight_dtype() if quantize else None) or dtype
            self.matmul = FloatMatmul()
            sharding = _KERNEL_SHARDING[parallel]
            if self.matmul.prefers_out_major(weight_dtype) and tp_size() == 1:
                # The CPU kernel's rows of w: [out, in], replicated (one device's whole
                # kernel, under which the layout metadata moves nothing).
                self.out_major = True
                kernel = unloaded((out_features, in_features), weight_dtype)
                self.kernel = param(kernel, sharding[::-1], out_major=True, **layout)
            else:
                kernel = unloaded((in_features, out_features), weight_dtype)
                self.kernel = param(kernel, sharding, **layout)
            self.weight_scale = self.weight_min = self.quant = None
        else:
            self._init_quantized(quantization, quant_layout, parallel, layout)
        bias_sharding = (TP_AXIS,) if parallel == "column" else (None,)
        bias_value = jnp.zeros((out_features,), dtype)
        self.bias = param(bias_value, bias_sharding, **layout) if bias else None
        self._init_lora(get_current_lora_config() if lora else None, parallel, dtype, layout)

    def _init_quantized(
        self, quantization: str, quant_layout: Any, parallel: Parallel, layout: dict[str, Any]
    ) -> None:
        """The 8/4-bit kernel of `quantization`, its scales (and minimums) and its op."""
        in_features, out_features = self.in_features, self.out_features
        scheme = get_scheme(quantization)
        has_minimum = quant_layout is not None and quant_layout.has_minimum
        # A row-parallel kernel's groups must not straddle two devices' rows.
        shards = tp_size() if parallel == "row" else 1
        self.quant = QuantMatmul(scheme.activations)
        groups, strips = quantized_groups(
            self.quant, scheme, quant_layout, in_features, out_features, shards
        )
        rows = in_features
        if scheme.packed:  # int4: two codes per byte along the input
            has_minimum, rows = True, in_features // 2
        if strips:
            self.kernel, self.weight_scale = q8_strip_params(
                in_features, out_features, groups, scheme, layout
            )
            self.weight_min = None
            self.matmul = None
            return
        kernel = unloaded((rows, out_features), scheme.weight_dtype)
        self.kernel = param(kernel, _KERNEL_SHARDING[parallel], quantized=scheme.name, **layout)
        # Scales (and minimums) per output column, laid out and split like the kernel's
        # columns; grouped along the input like the kernel's rows.
        sharding = (TP_AXIS if parallel == "row" and groups > 1 else None,)
        sharding += (_KERNEL_SHARDING[parallel][1],)
        self.weight_scale = WeightScale(
            unloaded((groups, out_features), jnp.float32),
            out_sharding=sharding,
            eager_sharding=False,
            **layout,
        )
        self.weight_min = (
            WeightScale(
                unloaded((groups, out_features), jnp.float32),
                out_sharding=sharding,
                eager_sharding=False,
                **layout,
            )
            if has_minimum
            else None
        )
        self.matmul = None

    def _init_lora(self, lora: Any, parallel: Parallel, dtype: Any, layout: dict[str, Any]) -> None:
        """LoRA adapter slots (A and B per slot) and their op; None without LoRA."""
        in_features, out_features = self.in_features, self.out_features
        lora_a = lora_b = op = None
        if lora is not None:
            # One rank block per checkpoint projection fused into this one (gate | up).
            parts, shards = layout.get("fused_shards") or (1, 1)
            rank = parts * lora.max_lora_rank
            slots = lora.max_loras
            lora_a = LoRAWeight(
                unloaded((in_features, slots, rank), dtype),
                out_sharding=_LORA_A_SHARDING[parallel],
                eager_sharding=False,
                lora_parts=parts,
            )
            lora_b = LoRAWeight(
                unloaded((slots, rank, out_features), dtype),
                out_sharding=_LORA_B_SHARDING[parallel],
                eager_sharding=False,
                lora_parts=parts,
                **layout,
            )
            op = LoRA(parts, shards)
        self.lora_a, self.lora_b, self.lora = lora_a, lora_b, op

    def keep_float(self, dtype: Any) -> None:
        """Float weights for this quantized projection (abstract model only): a quantized
        checkpoint left its layer unquantized (compressed-tensors ``ignore``)."""
        if self.quant is None:
            return
        metadata = self.kernel.get_metadata()
        if metadata.get("q8_strips"):  # one device's whole kernel: replicated
            metadata = dict(metadata, out_sharding=(None, None))
        metadata = {k: v for k, v in metadata.items() if k not in ("quantized", "q8_strips")}
        value = jax.ShapeDtypeStruct((self.in_features, self.out_features), dtype)
        self.kernel = nnx.Param(value, **metadata)
        self.weight_scale = self.weight_min = self.quant = None
        # A quantized layer was built without a float op (a static None): mark it data.
        self.matmul = nnx.data(FloatMatmul())

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.quant is not None:
            minimum = None if self.weight_min is None else self.weight_min[...]
            y = self.quant(x, self.kernel[...], self.weight_scale[...], minimum)
        elif self.out_major:
            y = self.matmul(x, self.kernel[...], transposed=True).astype(x.dtype)
        else:
            y = self.matmul(x, self.kernel[...])
        if self.lora is not None:
            slots = current_token_slots()
            if slots is not None:  # a step with no adapter skips the product
                a, b = self.lora_a[...], self.lora_b[...]
                y = jax.lax.cond(
                    jnp.any(slots > 0), lambda: y + self.lora(x, a, b, slots), lambda: y
                )
        return y + self.bias[...] if self.bias is not None else y


class VocabEmbedding(nnx.Module):
    """Token embedding table [vocab, hidden], sharded over the vocabulary.

    Under a scheme that quantizes embeddings (``int8``, ``w8a8``) the table is stored once
    as a quantized kernel [hidden, vocab] with scales [G, vocab] (one per vocabulary row,
    or per group of its inputs): a lookup dequantizes the gathered columns, and the LM
    head (`attend`, tied or not) is that kernel's quantized projection, so the table's
    bytes are read once per step in 8 bits. On the CPU kernel it is stored in strips as
    Linear does (`quantized_groups`), and a lookup gathers each row from its strip.
    `quantize=False` keeps it float.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
        quantize: bool = True,
    ) -> None:
        self.num_embeddings, self.embedding_dim, self.dtype = num_embeddings, embedding_dim, dtype
        quantization, quant_layout = get_current_quantization() if quantize else (None, None)
        scheme = None if quantization is None else get_scheme(quantization)
        weight = kernel = weight_scale = quant = matmul = None
        if scheme is None or not scheme.embeddings:
            table_dtype = (get_current_weight_dtype() if quantize else None) or dtype
            table = unloaded((num_embeddings, embedding_dim), table_dtype)
            weight = param(table, (TP_AXIS, None))
            matmul = FloatMatmul()
        else:
            quant = QuantMatmul(scheme.activations)
            groups, strips = quantized_groups(
                quant, scheme, quant_layout, embedding_dim, num_embeddings
            )
            if strips:
                # The LM head streams in strips too; a lookup gathers its rows from them.
                kernel, weight_scale = q8_strip_params(
                    embedding_dim, num_embeddings, groups, scheme, {}
                )
            else:
                codes = unloaded((embedding_dim, num_embeddings), scheme.weight_dtype)
                kernel = param(codes, (None, TP_AXIS), quantized=scheme.name)
                weight_scale = WeightScale(
                    unloaded((groups, num_embeddings), jnp.float32),
                    out_sharding=(None, TP_AXIS),
                    eager_sharding=False,
                )
        self.weight, self.kernel = weight, kernel
        self.weight_scale, self.quant, self.matmul = weight_scale, quant, matmul

    def keep_float(self, dtype: Any) -> None:
        """A float table (abstract model only): the checkpoint left it unquantized."""
        if self.quant is None:
            return
        value = jax.ShapeDtypeStruct((self.num_embeddings, self.embedding_dim), dtype)
        self.weight = nnx.data(nnx.Param(value, out_sharding=(TP_AXIS, None), eager_sharding=False))
        self.kernel = self.weight_scale = self.quant = None
        self.matmul = nnx.data(FloatMatmul())  # as in Linear.keep_float

    def __call__(self, input_ids: jax.Array) -> jax.Array:
        if self.quant is None:
            return jnp.take(self.weight[...], input_ids, axis=0).astype(self.dtype)
        kernel, scale = self.kernel[...], self.weight_scale[...]
        if kernel.ndim == 4:  # in strips: row i of the table is [i // 32, :, i % 32, :]
            strip, col = input_ids // Q8_STRIP_COLS, input_ids % Q8_STRIP_COLS
            codes = kernel[strip, :, col, :].reshape(*input_ids.shape, self.embedding_dim)
            scales = scale[strip, :, col]  # [..., G]
            groups = scales.shape[-1]
            rows = codes.reshape(*codes.shape[:-1], groups, -1).astype(jnp.float32)
            rows = rows * scales[..., None]
            return rows.reshape(*input_ids.shape, self.embedding_dim).astype(self.dtype)
        columns = jnp.take(kernel, input_ids, axis=1)  # [hidden, N]
        scales = jnp.take(scale, input_ids, axis=1)  # [G, N]
        groups, n = scales.shape
        rows = columns.reshape(groups, -1, n).astype(jnp.float32) * scales[:, None, :]
        return rows.reshape(self.embedding_dim, n).T.astype(self.dtype)

    def attend(self, hidden_states: jax.Array) -> jax.Array:
        """Logits against the table (tied LM head), in float32."""
        if self.quant is not None:
            x = hidden_states.astype(jnp.float32)
            return self.quant(x, self.kernel[...], self.weight_scale[...])
        return self.matmul(hidden_states, self.weight[...], transposed=True)


class PositionEmbedding(nnx.Module):
    """A learned absolute-position table [positions, hidden] (OPT, GPT-2), replicated."""

    def __init__(
        self, num_positions: int, embedding_dim: int, *, dtype: Any = jnp.float32, rngs: nnx.Rngs
    ) -> None:
        table = unloaded((num_positions, embedding_dim), dtype)
        self.weight = param(table, (None, None))

    def __call__(self, positions: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], positions, axis=0)


class ParallelLMHead(VocabEmbedding):
    """The output projection [vocab, hidden] (HF layout), sharded over the vocabulary."""

    def __call__(self, hidden_states: jax.Array) -> jax.Array:
        return self.attend(hidden_states)


class GatedMLP(nnx.Module):
    """down(act(gate(x)) * up(x)); gate and up share one column-parallel matmul.

    `hidden_act` is a transformers activation name: silu (SwiGLU), gelu_pytorch_tanh
    (Gemma's GeGLU), ...
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        bias: bool = False,
        hidden_act: str = "silu",
        dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ) -> None:
        self.shards = tp_size()
        check_split("intermediate_size", intermediate_size, self.shards)
        # gate_up_proj.kernel is [hidden, 2 * intermediate]: gate columns, then up columns
        # (under tensor parallelism: per shard, its gate columns then its up columns).
        self.gate_up_proj = Linear(
            hidden_size,
            2 * intermediate_size,
            bias=bias,
            parallel="column",
            dtype=dtype,
            rngs=rngs,
            layout={"fused_shards": (2, self.shards)},
        )
        self.down_proj = Linear(
            intermediate_size, hidden_size, bias=bias, parallel="row", dtype=dtype, rngs=rngs
        )
        self.act_fn = get_act_and_mul_fn(hidden_act)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(gated_activation(self.act_fn, self.gate_up_proj(x), self.shards))


def gated_activation(act_fn: Any, gate_up: jax.Array, shards: int) -> jax.Array:
    """act(gate) * up over [..., 2I] columns laid out per shard as [gate_s | up_s]."""
    if shards == 1:
        return act_fn(gate_up)
    lead, width = gate_up.shape[:-1], gate_up.shape[-1]
    out = act_fn(gate_up.reshape(*lead, shards, width // shards))
    return out.reshape(*lead, width // 2)


def merges_qkv() -> bool:
    """Whether Attention merges a checkpoint's separate q, k and v projections into one
    qkv_proj: one device's whole kernels (split over devices by columns, the merged
    kernel's parts would not line up with each device's heads, and XLA would move them
    between devices) and no LoRA (whose adapters target q_proj, k_proj and v_proj by
    name). One call reads the three kernels' bytes in one stream, as vLLM's QKV
    projection does; on SmolLM2's CPU decode step the gain is within the dev machine's
    run-to-run spread (benchmarks/RESULTS.md, session 17)."""
    return tp_size() == 1 and get_current_lora_config() is None


class Attention(nnx.Module):
    """Self-attention over the paged KV cache: q/k/v/o projections, q/k norm, rotary, op.

    `fused_qkv`: one qkv_proj (q, k, v output columns in that order, as Phi-3 and GPT-2
    checkpoints store them) instead of three. A checkpoint's separate q, k and v are
    merged into one too where nothing needs them apart (`merges_qkv`): the loader places
    each in its columns (xlm.models.weights), and a step reads the three kernels in one
    call. `rotary_emb=None`: no rotary (learned
    absolute positions). `qk_norm_offset`: the q/k RMSNorms scale by (offset + w) (Gemma 3).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary_emb: RotaryEmbedding | None,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        fused_qkv: bool = False,
        qk_norm_eps: float | None = None,
        qk_norm_offset: float = 0.0,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        scale: float | None = None,
        dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ) -> None:
        tp = tp_size()
        check_split("num_attention_heads", num_heads, tp)
        # Fewer KV heads than devices: each is stored `replicas` times, one per device.
        replicas = kv_head_replicas(num_kv_heads, tp)
        num_kv_heads *= replicas
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim

        def proj(n_out: int, bias: bool, layout: dict[str, Any] | None = None) -> Linear:
            return Linear(
                hidden_size,
                n_out,
                bias=bias,
                parallel="column",
                dtype=dtype,
                rngs=rngs,
                layout=layout,
            )

        kv_layout = {"head_replicas": (replicas, head_dim)}
        fused_qkv = fused_qkv or merges_qkv()
        if fused_qkv:
            if replicas > 1:
                raise ValueError(
                    f"num_key_value_heads={num_kv_heads // replicas} < tensor_parallel_size="
                    f"{tp}: KV-head replication is not supported for fused qkv projections"
                )
            self.qkv_proj = proj((num_heads + 2 * num_kv_heads) * head_dim, qkv_bias)
        else:
            self.q_proj = proj(num_heads * head_dim, qkv_bias)
            self.k_proj = proj(num_kv_heads * head_dim, qkv_bias, kv_layout)
            self.v_proj = proj(num_kv_heads * head_dim, qkv_bias, kv_layout)
        self.fused_qkv = fused_qkv
        self.o_proj = Linear(
            num_heads * head_dim, hidden_size, bias=o_bias, parallel="row", dtype=dtype, rngs=rngs
        )
        if qk_norm_eps is not None:
            norm_kw = dict(dtype=dtype, weight_offset=qk_norm_offset)
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, **norm_kw)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, **norm_kw)
        else:
            self.q_norm = self.k_norm = None
        self.rotary_emb = rotary_emb
        self.attn = PagedAttention(
            num_heads,
            num_kv_heads,
            head_dim,
            head_dim**-0.5 if scale is None else scale,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
        )

    def __call__(
        self,
        positions: jax.Array,
        hidden_states: jax.Array,
        kv_cache: jax.Array,
        metadata: AttentionMetadata,
    ) -> tuple[jax.Array, jax.Array]:
        t = hidden_states.shape[0]
        nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.fused_qkv:
            qkv = self.qkv_proj(hidden_states)
            q, k, v = qkv[:, :nq], qkv[:, nq : nq + nkv], qkv[:, nq + nkv :]
        else:
            q = self.q_proj(hidden_states)
            k = self.k_proj(hidden_states)
            v = self.v_proj(hidden_states)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
        out, kv_cache = self.attn(q, k, v, kv_cache, metadata)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim)), kv_cache


def rope_parameters(
    hf_config: Any, layer_type: str | None = None
) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from a transformers 4.x or 5.x config.

    `layer_type`: configs with per-layer-type rope (Gemma 3: "sliding_attention" and
    "full_attention") nest one parameter dict per type.
    """
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
        scaling = params
    else:
        scaling = getattr(hf_config, "rope_scaling", None) or params
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type in ("default", "mrope"):  # "mrope": Qwen2-VL's older name for default
        return float(theta), None
    return float(theta), {k: v for k, v in scaling.items() if k != "rope_theta"}


def rotary_from_config(
    hf_config: Any, head_dim: int, layer_type: str | None = None
) -> RotaryEmbedding:
    """The rotary embedding a transformers config describes (theta, scaling, partial dim)."""
    theta, scaling = rope_parameters(hf_config, layer_type)
    params = getattr(hf_config, "rope_parameters", None) or {}
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    if scaling is not None and "original_max_position_embeddings" not in scaling:
        original = getattr(hf_config, "original_max_position_embeddings", None)
        if original is not None:
            scaling = {**scaling, "original_max_position_embeddings": original}
    # Qwen2-VL's M-RoPE bands (transformers 5's rope_parameters or 4's rope_scaling).
    legacy = getattr(hf_config, "rope_scaling", None) or {}
    mrope = params.get("mrope_section") or legacy.get("mrope_section")
    return RotaryEmbedding(
        head_dim,
        int(head_dim * partial),
        hf_config.max_position_embeddings,
        theta,
        is_neox_style=True,
        rope_scaling=scaling,
        mrope_section=tuple(mrope) if mrope else None,
    )
