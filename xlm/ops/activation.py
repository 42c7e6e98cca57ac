"""Activations: plain and gated (x[..., :d] activated, times x[..., d:])."""

from __future__ import annotations

import jax

from xlm.ops.custom_op import CustomOp

GELU_APPROXIMATIONS = ("none", "tanh")


def _check_approximate(approximate: str) -> bool:
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(
            f"GELU approximate={approximate!r} is not supported; allowed: {GELU_APPROXIMATIONS}"
        )
    return approximate == "tanh"


@CustomOp.register("silu_and_mul")
class SiluAndMul(CustomOp):
    """silu(x[..., :d]) * x[..., d:] for x of last dimension 2d."""

    def __init__(self, *, enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)

    def forward_native(self, x: jax.Array) -> jax.Array:
        d = x.shape[-1] // 2
        return jax.nn.silu(x[..., :d]) * x[..., d:]


@CustomOp.register("gelu_and_mul")
class GeluAndMul(CustomOp):
    """gelu(x[..., :d]) * x[..., d:] (GeGLU); exact erf GELU or its tanh approximation."""

    def __init__(self, approximate: str = "none", *, enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)
        self.approximate = approximate
        self._tanh = _check_approximate(approximate)

    def forward_native(self, x: jax.Array) -> jax.Array:
        d = x.shape[-1] // 2
        return jax.nn.gelu(x[..., :d], approximate=self._tanh) * x[..., d:]


@CustomOp.register("gelu")
class Gelu(CustomOp):
    """GELU: exact (erf) or the tanh approximation (GPT-2's "gelu_new")."""

    def __init__(self, approximate: str = "none", *, enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)
        self.approximate = approximate
        self._tanh = _check_approximate(approximate)

    def forward_native(self, x: jax.Array) -> jax.Array:
        return jax.nn.gelu(x, approximate=self._tanh)


@CustomOp.register("relu")
class ReLU(CustomOp):
    """max(x, 0)."""

    def __init__(self, *, enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)

    def forward_native(self, x: jax.Array) -> jax.Array:
        return jax.nn.relu(x)


# transformers' ACT2FN names -> (op class, its GELU approximation or None).
_HF_ACTIVATIONS = {
    "gelu": (Gelu, "none"),
    "gelu_new": (Gelu, "tanh"),
    "gelu_fast": (Gelu, "tanh"),
    "gelu_pytorch_tanh": (Gelu, "tanh"),
    "relu": (ReLU, None),
}
_HF_GATED = {
    "gelu": (GeluAndMul, "none"),
    "gelu_new": (GeluAndMul, "tanh"),
    "gelu_pytorch_tanh": (GeluAndMul, "tanh"),
    "silu": (SiluAndMul, None),
    "swish": (SiluAndMul, None),
}


def _build(table: dict, name: str, kind: str) -> CustomOp:
    if name not in table:
        raise ValueError(f"{kind} activation {name!r} is not supported; allowed: {sorted(table)}")
    cls, approximate = table[name]
    return cls() if approximate is None else cls(approximate)


def get_act_fn(name: str) -> CustomOp:
    """The op for a transformers activation name (hidden_act / activation_function)."""
    return _build(_HF_ACTIVATIONS, name, "The")


def get_act_and_mul_fn(name: str) -> CustomOp:
    """The gated op act(x[..., :d]) * x[..., d:] for a transformers activation name."""
    return _build(_HF_GATED, name, "Gated")
