"""attention_bwd_sm90_big: the Hopper (sm_90a) FlashAttention backward for head dims 136..256.

Same contract and host plan as :mod:`rtkernels.ops.attention_bwd_sm90` (its ``launch``, and its
``VarlenBackwardPlan`` for varlen calls: the pre-pass, tensor maps, dq_accum / dq_count, the dQ
conversion; layouts, GQA, bottom-right causal, windows, softcap, varlen, ``deterministic``); the
main kernel differs (templates/attention_bwd_sm90_big.cu.j2): a CTA owns 64 keys, the two consumer warpgroups split
S^T / dP^T by query columns and dK / dV / dQ by head-dim columns (P^T and dS^T meet in shared
memory), and dQ goes from registers to the f32 accumulator by 16-byte reductions.  The template's
header comment has the register and shared-memory counts that chose this layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..config import register_family
from ..errors import ConfigError
from .attention_bwd_sm90 import AttentionBwdSm90Config, SMEM_LIMIT_SM90, _ALIGN_SLACK, _BLOCK_M

FAMILY = "attention_bwd_sm90_big"
MIN_HEAD_DIM = 136
MAX_HEAD_DIM = 256
_BLOCK_N = 64
# Off: head dims 136..256 go back to the mma.sync kernel (attention_bwd_sm90.picks reads this).
ENABLED = True


def column_split(head_dim: int) -> int:
    """Head-dim columns of consumer warpgroup 0 (the other takes the rest): the multiple of 32
    nearest half the head dim (N-major wgmma operands start on a 32-column block of the 64-byte
    swizzle), e.g. 96/96 at 192, 64/72 at 136, 96/80 at 176, 128/120 at 248."""
    return 32 * ((head_dim // 2 + 16) // 32)


@register_family
@dataclass(frozen=True)
class AttentionBwdSm90BigConfig(AttentionBwdSm90Config):
    """One specialization of the Hopper backward kernel for head dims 136..256.

    Parameters
    ----------
    dtype, head_dim, causal, has_window, has_softcap, is_varlen : as
        :class:`rtkernels.ops.attention_bwd_sm90.AttentionBwdSm90Config`; head_dim a multiple of 8
        in [136, 256].
    deterministic : add each query tile's dQ partials in key-tile order (bit-identical runs).
    num_stages : depth of the Q/dO/lse/delta ring (1 or 2; 2 fits every head dim up to 256).
    dq_mode : "red" - each thread adds its dQ fragments with 16-byte reductions (red.global.add.v4);
        "bulk" - each consumer warpgroup stages its half of the f32 dQ tile in shared memory and one
        thread adds it with a TMA bulk reduction (cp.reduce.async.bulk; +64 x head_dim x 4 B of
        shared memory: two ring stages fit up to head_dim 192).  Not with ``deterministic``.
    """

    family: ClassVar[str] = FAMILY
    template: ClassVar[str] = "attention_bwd_sm90_big.cu.j2"
    kernels: ClassVar[tuple[str, ...]] = ("attention_bwd_sm90_big", "attention_bwd_sm90_big_dot",
                                          "attention_bwd_sm90_big_dq_convert")
    tma_box_cols: ClassVar[int] = 32   # 64-byte swizzled column blocks (attention_bwd_sm90: 64, 128 B)
    tma_swizzle: ClassVar[int] = 64

    dq_mode: str = "red"

    def __post_init__(self):
        self._check_shape()
        if not MIN_HEAD_DIM <= self.head_dim <= MAX_HEAD_DIM:
            self._fail("head_dim", f"a multiple of 8 in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}] (smaller head dims use "
                                   "attention_bwd_sm90)")
        self._check_choice("deterministic", (False, True))
        self._check_choice("num_stages", (1, 2))
        self._check_choice("dq_mode", ("red", "bulk"))
        if self.dq_mode == "bulk" and self.deterministic:
            self._fail("dq_mode", '"red" with deterministic=True (the ordered flush adds from registers)')
        if self.shared_mem_bytes > SMEM_LIMIT_SM90:
            self._fail("num_stages", f"a ring that fits sm_90's {SMEM_LIMIT_SM90} B of shared memory: "
                                     f"{self.shared_mem_bytes} B at head_dim={self.head_dim}")

    @classmethod
    def heuristic_defaults(cls, params: dict[str, Any], arch: str | None) -> dict[str, Any]:
        """head_dim 192 when not given (the inherited default, 64, is attention_bwd_sm90's range):
        ``rtk.compile("attention_bwd_sm90_big")`` builds a config the op runs."""
        return {} if "head_dim" in params else {"head_dim": 192}

    @property
    def block_n(self) -> int:
        return _BLOCK_N

    @property
    def split(self) -> int:
        return column_split(self.head_dim)

    @property
    def d_blocks(self) -> int:
        """32-column blocks per Q/dO/K/V tile: consumer 1 reads columns [split, split + the wider share)."""
        wide = max(self.split, self.head_dim - self.split)
        return -(-(self.split + wide) // 32)

    @property
    def shared_mem_bytes(self) -> int:
        """K and V (64 rows), num_stages x (Q, dO tiles of 64 rows + 64 lse and delta values), two
        P^T and two dS^T buffers (64 x 64 x 2 B), the f32 dQ staging tile (dq_mode "bulk"), the
        mbarriers and 1 KiB to align the base."""
        kv = 2 * self.d_blocks * _BLOCK_N * 64
        ring = self.num_stages * (2 * self.d_blocks * _BLOCK_M * 64 + 2 * _BLOCK_M * 4)
        pds = 4 * _BLOCK_N * 128
        dq = _BLOCK_M * self.head_dim * 4 if self.dq_mode == "bulk" else 0
        bars = 8 * (1 + 2 * self.num_stages)
        return kv + ring + pds + dq + bars + _ALIGN_SLACK

    def template_params(self) -> dict[str, Any]:
        p = super().template_params()
        p.update(split=self.split)
        return p

    @property
    def register_split(self) -> tuple[int, int]:
        """(producer, consumer) registers per thread after setmaxnreg: 24 / 240, the whole 168 x 384
        file (2 x (240 - 168) = 168 - 24).  The producer is one TMA-issuing thread with no dQ warp
        and fits 24; at 40 / 232 ptxas spilled 28 B at d248 causal deterministic (NVRTC 13.5), at
        24 / 240 no config spills, masked ones included (all three options at d256: clean)."""
        return (24, 240)


def choose_config(dtype: str, head_dim: int, causal: bool, deterministic: bool, **mask_flags) -> AttentionBwdSm90BigConfig:
    """Two ring stages (the next tile's 64 KiB of Q/dO at d256 land while this one computes; it
    fits up to d256: 226 KiB).  dQ: the bulk reduction where two stages still fit it and the call
    is neither deterministic nor masked, else the threads' 16-byte reductions.  Measured (H100,
    2026-11-25, bf16, TFLOP/s red / bulk, tools/bench_attention_bwd.py --alt dq_mode=bulk):
    d192 S 4k / 16k non-causal 318 / 366, 351 / 398; causal 282 / 318, 347 / 391 (+13%: one TMA
    reduction per tile instead of 64 x head_dim / 4 red.global ops through L2); d256 bulk fits one
    stage only: non-causal 342 / 342, 364 / 374, causal 288 / 253, 368 / 289."""
    cfg = AttentionBwdSm90BigConfig(dtype=dtype, head_dim=head_dim, causal=causal, deterministic=deterministic,
                                    num_stages=2, **mask_flags)
    if deterministic or any(mask_flags.values()):
        return cfg
    try:
        return cfg.replace(dq_mode="bulk")
    except ConfigError:   # two stages and the dQ staging tile exceed shared memory (head_dim > 192)
        return cfg


def heuristic_configs(dtypes=("float16", "bfloat16")) -> list[AttentionBwdSm90BigConfig]:
    """Every unmasked config the op can dispatch to."""
    return [choose_config(dt, d, c, det) for dt in dtypes for d in range(MIN_HEAD_DIM, MAX_HEAD_DIM + 1, 8)
            for c in (False, True) for det in (False, True)]
