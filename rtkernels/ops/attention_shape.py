"""AttentionShape: the fields and checks every attention kernel config shares (the forward and
backward, mma.sync and Hopper, decode).  Its own module so that the families' modules import it
without importing each other: :mod:`rtkernels.ops.attention` dispatches to
:mod:`rtkernels.ops.attention_sm90`, which subclasses this."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..config import KernelConfig


@dataclass(frozen=True)
class AttentionShape(KernelConfig):
    """What every attention kernel config shares: dtype, head_dim and the compile-time part of the
    mask (:class:`rtkernels.ops.attention_mask.AttentionMask`: causal, has_window, has_softcap,
    is_varlen; fields first, so subclasses add their tile fields after them) and the derived
    values the templates re-check.  With the three options off a kernel compiles exactly as it
    did before they existed."""

    dtype: str = "float16"
    head_dim: int = 64
    causal: bool = False
    has_window: bool = False
    has_softcap: bool = False
    is_varlen: bool = False

    MASK_FIELDS: ClassVar[tuple[str, ...]] = ("causal", "has_window", "has_softcap", "is_varlen")

    def _check_shape(self) -> None:
        self._check_dtype("dtype", ("float16", "bfloat16"))
        self._check_int("head_dim", 8, 256, multiple_of=8)
        for f in self.MASK_FIELDS:
            self._check_choice(f, (False, True))

    def mask_flags(self) -> dict[str, bool]:
        return {f: getattr(self, f) for f in self.MASK_FIELDS if f != "causal"}

    @property
    def threads_per_block(self) -> int:
        return 32 * self.num_warps

    @property
    def head_dim_padded(self) -> int:
        """Q/K width in shared memory: QK^T steps k by 16."""
        return -(-self.head_dim // 16) * 16
