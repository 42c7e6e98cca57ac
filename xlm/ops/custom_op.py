"""CustomOp: the base of op layers, with per-platform dispatch chosen at construction."""

from __future__ import annotations

from typing import Any, ClassVar

from flax import nnx

from xlm import platforms
from xlm.config import CompilationConfig, get_current_compilation_config
from xlm.logger import init_logger

logger = init_logger(__name__)


_NNX_META = type(nnx.Module)


class _CustomOpMeta(_NNX_META):
    """Builds the out-of-tree replacement when one is registered for an in-tree op."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        name = cls.__dict__.get("name")
        if name is not None and CustomOp.op_registry.get(name) is cls:
            cls = CustomOp.op_registry_oot.get(name, cls)
        return _NNX_META.__call__(cls, *args, **kwargs)


class CustomOp(nnx.Module, metaclass=_CustomOpMeta):
    """An op layer with a plain-jnp native path and optional platform kernels."""

    op_registry: ClassVar[dict[str, type[CustomOp]]] = {}
    op_registry_oot: ClassVar[dict[str, type[CustomOp]]] = {}
    name: ClassVar[str]
    # Whether the platform kernel is used when custom_ops does not mention this op.
    default_enabled: ClassVar[bool] = False

    def __init__(self, *, enforce_enable: bool = False) -> None:
        self._forward_name = self.dispatch_forward(enforce_enable)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, self._forward_name)(*args, **kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        """The plain-jnp definition of the op, traced into XLA."""
        raise NotImplementedError

    def forward_cuda(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def forward_rocm(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_cuda(*args, **kwargs)

    def forward_tpu(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def forward_cpu(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def forward_oot(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def dispatch_forward(self, enforce_enable: bool = False) -> str:
        """Name of the forward method this instance runs, chosen from platform and config."""
        if not (enforce_enable or self.enabled()):
            return "forward_native"

        if platforms.current_platform.is_tpu():
            return "forward_tpu"
        if platforms.current_platform.is_cuda():
            return "forward_cuda"
        if platforms.current_platform.is_rocm():
            return "forward_rocm"
        if platforms.current_platform.is_cpu():
            return "forward_cpu"
        if platforms.current_platform.is_out_of_tree():
            return "forward_oot"
        return "forward_native"

    @classmethod
    def enabled(cls, compilation_config: CompilationConfig | None = None) -> bool:
        """Whether this op uses its platform kernel under the given custom_ops setting."""
        custom_ops = (compilation_config or get_current_compilation_config()).custom_ops
        check_custom_ops(custom_ops)
        if f"+{cls.name}" in custom_ops:
            return True
        if f"-{cls.name}" in custom_ops:
            return False
        if "all" in custom_ops:
            return True
        if "none" in custom_ops:
            return False
        return cls.default_enabled

    @classmethod
    def register(cls, name: str):
        """Class decorator recording an in-tree op under `name`."""

        def decorator(op_cls: type[CustomOp]) -> type[CustomOp]:
            if name in cls.op_registry:
                raise ValueError(f"custom op {name!r} is already registered")
            op_cls.name = name
            cls.op_registry[name] = op_cls
            return op_cls

        return decorator

    @classmethod
    def register_oot(cls, name: str | None = None, _decorated_op_cls: type | None = None):
        """Class decorator substituting an out-of-tree subclass for the in-tree op `name`."""

        def decorator(op_cls: type[CustomOp]) -> type[CustomOp]:
            reg_name = name or op_cls.__name__
            cls.op_registry_oot[reg_name] = op_cls
            logger.info("Out-of-tree op %s registered for %s.", op_cls.__qualname__, reg_name)
            return op_cls

        if _decorated_op_cls is not None:
            return decorator(_decorated_op_cls)
        return decorator


def check_custom_ops(custom_ops: list[str]) -> None:
    """Raise if custom_ops names an op that is not registered.

    Every in-tree op is registered by then: this module lives in the xlm.ops package, and
    importing any module of it first runs the package's __init__, which imports each op.
    """
    for entry in custom_ops:
        if entry in ("all", "none"):
            continue
        op_name = entry[1:]
        if op_name not in CustomOp.op_registry:
            raise ValueError(
                f"CompilationConfig.custom_ops entry {entry!r} names an unknown op; "
                f"registered ops: {sorted(CustomOp.op_registry)}"
            )
