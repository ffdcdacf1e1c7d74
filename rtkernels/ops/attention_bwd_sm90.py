"""attention_bwd_sm90: the Hopper (sm_90a) FlashAttention backward behind ``rtk.attention_backward``.

Same contract as :mod:`rtkernels.ops.attention_bwd` (layouts, GQA, bottom-right causal, lse,
fp16/bf16, ``deterministic``); the main kernel differs (templates/attention_bwd_sm90.cu.j2): a
producer warpgroup streams Q, dO, lse and delta tiles by TMA, two consumer warpgroups own 64 keys
each and compute S^T, dP^T, dV, dK and (alternating) dQ with wgmma.  The pre-pass (delta,
lse*log2e) and the dQ conversion are this module's own entry points (rtk/attn_bwd_sm90.cuh).
Head dims up to 128: beyond that, dK and dV alone would need 256 accumulator registers per
thread; head dims 136..256 run attention_bwd_sm90_big (the head dim split between the consumer
warpgroups) through this module's :func:`picks`, :func:`choose_config` and :func:`launch`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..config import register_family
from .attention import AttentionShape
from .attention_sm90 import SMEM_LIMIT_SM90, _map_strides, is_sm90, tma_strides

FAMILY = "attention_bwd_sm90"
MAX_HEAD_DIM = 128
_ALIGN_SLACK = 1024
_BLOCK_M = 64        # query rows per step (the template's BLOCK_M)
_CONSUMERS = 2


@register_family
@dataclass(frozen=True)
class AttentionBwdSm90Config(AttentionShape):
    """One specialization of the Hopper backward kernel.

    Parameters
    ----------
    dtype, head_dim, causal : as :class:`rtkernels.ops.attention_bwd.AttentionBwdConfig`;
        head_dim a multiple of 8 in [8, 128].
    deterministic : add the key tiles' dQ partials in a fixed order per query tile (bit-identical
        results run to run) instead of unordered float32 reductions.
    num_stages : depth of the Q/dO/lse/delta ring (2 or 3).
    """

    family: ClassVar[str] = FAMILY
    template: ClassVar[str] = "attention_bwd_sm90.cu.j2"
    kernels: ClassVar[tuple[str, ...]] = ("attention_bwd_sm90", "attention_bwd_sm90_dot", "attention_bwd_sm90_dq_convert")
    needs_arch_specific: ClassVar[bool] = True
    expects_tensor_cores: ClassVar[bool] = True
    expected_global_width: ClassVar[int | None] = None   # TMA loads; dK/dV/dQ leave from mma registers
    tma_box_cols: ClassVar[int] = 64   # Q/dO/K/V tiles in column blocks of 64 (128-byte swizzle)
    tma_swizzle: ClassVar[int] = 128

    deterministic: bool = False
    num_stages: int = 2

    def __post_init__(self):
        self._check_shape()
        if self.head_dim > MAX_HEAD_DIM:
            self._fail("head_dim", f"a multiple of 8 in [8, {MAX_HEAD_DIM}] (dK and dV of 64 keys x head_dim stay "
                                   "in one warpgroup's registers; larger head dims use attention_backward)")
        self._check_choice("deterministic", (False, True))
        self._check_choice("num_stages", (2, 3))
        if self.shared_mem_bytes > SMEM_LIMIT_SM90:
            self._fail("num_stages", f"a ring that fits sm_90's {SMEM_LIMIT_SM90} B of shared memory: "
                                     f"{self.shared_mem_bytes} B at head_dim={self.head_dim}")

    @property
    def num_warps(self) -> int:
        return 4 * (1 + _CONSUMERS)

    @property
    def block_n(self) -> int:
        return 64 * _CONSUMERS

    @property
    def d_blocks(self) -> int:
        return -(-self.head_dim // 64)

    @property
    def shared_mem_bytes(self) -> int:
        """K and V (block_n rows), num_stages x (Q, dO tiles of 64 rows + 64 lse and delta values),
        two dS^T buffers (block_n x 64 x 2 B), two f32 dQ tiles (64 x head_dim), the mbarriers and
        1 KiB to align the base."""
        kv = 2 * self.d_blocks * self.block_n * 128
        ring = self.num_stages * (2 * self.d_blocks * _BLOCK_M * 128 + 2 * _BLOCK_M * 4)
        ds = 2 * self.block_n * 128
        dq = 2 * _BLOCK_M * self.head_dim * 4
        bars = 8 * (1 + 2 * self.num_stages + 4)
        return kv + ring + ds + dq + bars + _ALIGN_SLACK

    def template_params(self) -> dict[str, Any]:
        from .attention_bwd import LSE_PAD
        p = super().template_params()
        p.update(consumers=_CONSUMERS, smem_bytes=self.shared_mem_bytes, lse_pad=LSE_PAD,
                 producer_regs=self.register_split[0], consumer_regs=self.register_split[1])
        return p

    @property
    def register_split(self) -> tuple[int, int]:
        """(producer, consumer) registers per thread after setmaxnreg.  The CTA starts with 168 per
        thread (384 threads under one 64 Ki file, rounded down to 8) and setmaxnreg only moves
        registers within the CTA: consumers may gain what the producer gives up,
        2 x (C - 168) <= 168 - P.  24/240 spills 8-52 bytes in the producer warpgroup (TMA issue +
        the dQ warp's bookkeeping); 32/240 asks for 1 Ki more registers than the CTA owns and
        hangs (H200, 2026-11-21).  At 232, ptxas spills only head_dim 120 non-causal (372 B): that
        case stays on the mma.sync kernel (:func:`eligible`).  Varlen and windows put their
        bookkeeping (sequence offsets, padded rows, window ranges) on the producer side: at 40 it
        spills 8 B at d64 causal varlen (NVRTC 13.5), so those variants give it 48 and the
        consumers 224 (128 x 48 + 256 x 224 = 63488)."""
        return (48, 224) if (self.is_varlen or self.has_window) else (40, 232)


# ---- heuristics ---------------------------------------------------------------------------
def choose_config(dtype: str, head_dim: int, causal: bool, deterministic: bool, **mask_flags) -> AttentionBwdSm90Config:
    """The config the op runs: head dims <= 128 this family's kernel, 136..256 attention_bwd_sm90_big's
    (:mod:`rtkernels.ops.attention_bwd_sm90_big`, which splits the head dim between the consumer
    warpgroups).  Two ring stages: Q/dO of the next tile land while this one computes, and 8+ KiB
    more per stage buys nothing once a step's GEMMs outlast its loads.  ``mask_flags``: the other
    compile-time mask fields (has_window, has_softcap, is_varlen)."""
    if head_dim > MAX_HEAD_DIM:
        from . import attention_bwd_sm90_big as big
        return big.choose_config(dtype, head_dim, causal, deterministic, **mask_flags)
    return AttentionBwdSm90Config(dtype=dtype, head_dim=head_dim, causal=causal, deterministic=deterministic,
                                  **mask_flags)


def heuristic_configs(dtypes=("float16", "bfloat16")) -> list[AttentionBwdSm90Config]:
    """Every config the op can dispatch to."""
    return [choose_config(dt, d, c, det) for dt in dtypes for d in range(8, MAX_HEAD_DIM + 1, 8)
            for c in (False, True) for det in (False, True) if picks(d, c)]


# ---- dispatch and launch ------------------------------------------------------------------
ENABLED = True


# (head_dim, causal) whose Hopper kernel spills (ptxas of NVRTC 13.5, sm_90a); checked by the tests.
# (120, False) spilled 372 B; since the mask options' rewrite of the range code it builds clean under
# NVRTC 13.5 (2026-11, CPU), but stays on the mma.sync kernel until a GPU run (NVRTC 13.0 there)
# shows it clean and correct.
SPILLING = {(120, False)}


def picks(head_dim: int, causal: bool, mask_flags: tuple = (), dtype: str = "bfloat16",
          deterministic: bool = False) -> bool:
    """The op's rule for a (head_dim, causal, mask options) on sm_90, before looking at the arrays -
    the one place that sends a backward to a Hopper kernel: switched on, head_dim <= 128 (this
    family) or 136..256 (attention_bwd_sm90_big, switched by its own ``ENABLED``), and not a
    spilling case.  Masked variants: ptxas's report of the build itself, compiled here on first
    use (it is the build the op then runs); a spilling one keeps the mma.sync kernel, except for
    the small bookkeeping spill :func:`bookkeeping_spill_only` allows (softcap at d128 causal,
    NVRTC 13.5: 8 B).  The three options together at d128 spill more and stay on the mma.sync
    kernel; no head dim > 128 spills."""
    if head_dim > MAX_HEAD_DIM:
        from . import attention_bwd_sm90_big as big
        if not (ENABLED and big.ENABLED and head_dim <= big.MAX_HEAD_DIM):
            return False
    elif not (ENABLED and (head_dim, bool(causal)) not in SPILLING):
        return False
    if not any(v for _, v in mask_flags):
        return True
    key = (head_dim, bool(causal), mask_flags, dtype, bool(deterministic))
    if key not in _MASKED_CLEAN:
        from ..kernel import get_kernel
        cfg = choose_config(dtype, head_dim, causal, deterministic, **dict(mask_flags))
        r = get_kernel(cfg, cfg.kernels[0], arch="sm_90a").resources
        _MASKED_CLEAN[key] = bookkeeping_spill_only(r)
    return _MASKED_CLEAN[key]


_MASKED_CLEAN: dict = {}

# A masked variant may spill at most this many bytes (two 32-bit values) and still run here.  Softcap at
# d128 causal (NVRTC 13.5, 40 / 232 registers) stores two loop-bookkeeping integers once, in the prologue,
# and reloads them about once per query tile (9 LDL in the SASS, none among the per-score math);
# the alternative, the mma.sync backward, ran at 0.45x of the plain Hopper backward (H100, 2026-11-25).
BOOKKEEPING_SPILL_BYTES = 8


def bookkeeping_spill_only(resources) -> bool:
    """No spill, or one of at most :data:`BOOKKEEPING_SPILL_BYTES` stored bytes (the softcap case)."""
    return resources.spill_stores <= BOOKKEEPING_SPILL_BYTES and resources.stack_frame <= BOOKKEEPING_SPILL_BYTES


def runnable(arch: str, views, seqlen_k: int) -> bool:
    """An sm_90 device, at least one key and strides a tensor map can encode (the forward's rules)."""
    return is_sm90(arch) and seqlen_k >= 1 and all(tma_strides(v) for v in views)


def eligible(arch: str, views, seqlen_k: int, head_dim: int, causal: bool = False, mask_flags: tuple = (),
             dtype: str = "bfloat16", deterministic: bool = False) -> bool:
    """Whether rtk.attention_backward picks this kernel by itself: :func:`picks` and :func:`runnable`."""
    return runnable(arch, views, seqlen_k) and picks(head_dim, causal, mask_flags, dtype, deterministic)


_KERNELS: dict = {}


def kernels_for(cfg: AttentionBwdSm90Config, arch: str = "sm_90a"):
    """(main kernel, pre-pass, dQ conversion), memoized per (config, arch)."""
    key = (cfg, arch)
    hit = _KERNELS.get(key)
    if hit is None:
        from ..kernel import get_kernel
        hit = _KERNELS[key] = tuple(get_kernel(cfg, name, arch=arch) for name in cfg.kernels)
    return hit


def launch(cfg: AttentionBwdSm90Config, arch: str, q_, k_, v_, o_, do_, lse_, lse2, delta, dq_, dk_, dv_, strides,
           softmax_scale: float, dot_grid, stream=None, mask_args=(0, 0, 0.0), vl=None) -> None:
    """Pre-pass (delta and lse*log2e into lse2/delta, the op's padded buffers, on ``dot_grid``),
    main kernel and dQ conversion over CuPy views (bfloat16 as uint16).  ``strides``: the element
    strides of o, do, dq, dk, dv; ``mask_args``: (window_left, window_right, softcap); ``vl``: the
    checked cu_seqlens (rtkernels.ops.attention_mask.Varlen) of a varlen call, whose views are
    (1, total, heads, head_dim) and whose lse2/delta are (heads, padded rows)."""
    import cupy
    from ..kernel import _StreamPtr
    from ..tma import tensor_map
    from ._arrays import cupy_stream
    from .attention import _schedule_for
    from .attention_bwd import _DOT_THREADS   # the template's DOT_THREADS
    kern, dot, convert = kernels_for(cfg, arch)
    s_o, s_do, s_dq, s_dk, s_dv = strides
    cu_q, cu_k, nb = (vl.cu_q, vl.cu_k, vl.batch) if vl else (None, None, q_.shape[0])
    dot.launch(dot_grid, (_DOT_THREADS,), o_, do_, lse_, lse2, delta, q_.shape[1], *s_o[:3], *s_do[:3], cu_q, nb,
               stream=stream)
    batch, seqlen_q, nheads, _ = q_.shape
    seqlen_k, nheads_kv = k_.shape[1], k_.shape[2]
    dt = cfg.dtype
    # boxes one swizzle span wide: 64 columns = 128 bytes (SW128), or 32 = 64 bytes (the big kernel's SW64)
    box = lambda rows: (1, rows, 1, cfg.tma_box_cols)   # noqa: E731
    sw = cfg.tma_swizzle
    maps = (tensor_map(q_, dt, q_.shape, _map_strides(q_), box(_BLOCK_M), swizzle=sw),
            tensor_map(k_, dt, k_.shape, _map_strides(k_), box(cfg.block_n), swizzle=sw),
            tensor_map(v_, dt, v_.shape, _map_strides(v_), box(cfg.block_n), swizzle=sw),
            tensor_map(do_, dt, do_.shape, _map_strides(do_), box(_BLOCK_M), swizzle=sw))
    # varlen: 64-row tiles of each head's padded rows (lse2.shape[-1], a multiple of 128)
    m_tiles = lse2.shape[-1] // _BLOCK_M if vl else -(-seqlen_q // _BLOCK_M)
    # f32 dQ tiles in the consumers' fragment order, and (deterministic) 4 int32 per query tile for
    # the ordered additions (one 16-byte acquire load each); zeroed on the launch stream
    with cupy_stream(stream):
        dq_accum = cupy.empty((batch, nheads, m_tiles, _BLOCK_M * cfg.head_dim), cupy.float32)
        count = cupy.empty((batch, nheads, m_tiles, 4), cupy.int32) if cfg.deterministic else None
    sptr = cupy.cuda.get_current_stream().ptr if stream is None else (
        stream.ptr if hasattr(stream, "ptr") else _StreamPtr(stream).ptr)
    for buf in (dq_accum, count):
        if buf is not None:
            cupy.cuda.runtime.memsetAsync(buf.data.ptr, 0, buf.nbytes, sptr)
    if vl is None:
        grid, sched = (-(-seqlen_k // cfg.block_n), nheads_kv, batch), None
    else:   # key tiles of the packed sequences; descending where the deterministic causal order needs it
        sched, slots = _schedule_for(vl, cfg.block_n, cfg.causal and cfg.deterministic, arch, stream,
                                     cu_tiles=vl.cu_k, cu_other=vl.cu_q, totals=(vl.total_k, vl.total_q),
                                     max_seqlen=vl.max_seqlen_k)
        grid = (nheads_kv * slots,)
    kern.launch(grid, (cfg.threads_per_block,), *maps,
                lse2, delta, dq_accum, count, dk_, dv_, seqlen_q, seqlen_k, nheads // nheads_kv, nheads,
                *s_dk[:3], *s_dv[:3], float(softmax_scale), cu_q, cu_k, sched, nb, *mask_args,
                shared_mem=cfg.shared_mem_bytes, stream=stream)
    convert.launch((m_tiles, nheads, batch), (128,), dq_accum, dq_, seqlen_q, *s_dq[:3], float(softmax_scale), cu_q,
                   nb, stream=stream)

