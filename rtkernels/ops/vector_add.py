"""vector_add: the simplest kernel family (one element per thread)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..config import KernelConfig, register_family
from ..errors import ConfigError
from ..kernel import get_kernel
from ._arrays import as_device_array, dtype_name, new_like


@register_family
@dataclass(frozen=True)
class VectorAddConfig(KernelConfig):
    """c = a + b elementwise; float math for half types."""

    family: ClassVar[str] = "vector_add"
    template: ClassVar[str] = "vector_add.cu.j2"
    kernels: ClassVar[tuple[str, ...]] = ("vector_add",)
    dtype: str = "float32"
    block_size: int = 256

    def __post_init__(self):
        self._check_dtype("dtype", ("float16", "bfloat16", "float32"))
        self._check_int("block_size", 32, 1024, power_of_two=True)

    @property
    def threads_per_block(self) -> int:
        return self.block_size


def vector_add(a, b, out=None, *, block_size: int = 256, stream=None):
    """``a + b`` for 1-D float16/bfloat16/float32 device arrays of equal length."""
    a_, b_ = as_device_array(a, "vector_add", "a"), as_device_array(b, "vector_add", "b")
    da, db = dtype_name(a), dtype_name(b)
    if da != db:
        raise ConfigError(f"vector_add: a and b must have the same dtype, got {da} and {db}")
    if a_.shape != b_.shape or a_.ndim != 1:
        raise ConfigError(f"vector_add: a and b must be 1-D of equal length, got shapes {a_.shape} and {b_.shape}")
    if not (a_.flags.c_contiguous and b_.flags.c_contiguous):
        raise ConfigError("vector_add: a and b must be contiguous")
    k = get_kernel(VectorAddConfig(dtype=da, block_size=block_size))
    if out is None:
        out = new_like(a, a_.shape)
    out_ = as_device_array(out, "vector_add", "out")
    if out_.shape != a_.shape or dtype_name(out) != da or not out_.flags.c_contiguous:
        raise ConfigError(f"vector_add: out must be a contiguous {da} array of shape {a_.shape}")
    n = a_.size
    k.launch(((n + block_size - 1) // block_size,), (block_size,), a, b, out, n, stream=stream)
    return out
