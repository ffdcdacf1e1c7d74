"""attention_bwd_sm90_big: the Hopper (sm_90a) FlashAttention backward for head dims 136..256.

Same contract and host plan as :mod:`rtkernels.ops.attention_bwd_sm90` (its ``launch``, and its
``VarlenBackwardPlan`` for varlen calls: the pre-pass, tensor maps, dq_accum / dq_count, the dQ
conversion; layouts, GQA, bottom-right causal, windows, softcap, varlen, ``deterministic``); the
main kernel differs (templates/attention_bwd_sm90_big.cu.j2): a CTA owns 64 keys, the two consumer warpgroups split
S^T / dP^T by query columns and dK / dV / dQ by head-dim columns (P^T and dS^T meet in shared
memory), and dQ goes from registers to the f32 accumulator by 16-byte reductions.  The template's
header comment has the register and shared-memory counts that chose this layout.  ``layout="qk"``
is FlashAttention-3/4's sm90 orientation: queries as wgmma M, each consumer warpgroup owns half
the CTA's keys (96 keys per CTA up to head dim 192), dK^T / dV^T with the head dim as M, only dQ
reads the other warpgroup's dS; :func:`choose_config` runs it up to head dim 192 (neither
deterministic nor masked).  Opt-in options of both layouts (A/B: session 11, docs/RESULTS.md): a separate
dO ring (``do_stages``), the bulk dQ reduction staged in the Q/dO ring stage (``dq_mode="ring"``: two
stages with it at d256), and the options shared with attention_bwd_sm90 (defined there): a
heaviest-first causal grid (``lpt_grid``, attention_bwd_sm90.lpt_group) and a non-causal walk that
starts each CTA at its diagonal query tile (``stagger``; A/B: tools/ab_bwd_s12.sh).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..config import register_family
from .attention_bwd_sm90 import AttentionBwdSm90Config, SMEM_LIMIT_SM90, _ALIGN_SLACK, _BLOCK_M, _CONSUMERS

FAMILY = "attention_bwd_sm90_big"
MIN_HEAD_DIM = 136
MAX_HEAD_DIM = 256
_KEY_BLOCKS = (64, 96)   # keys per CTA (the template's BLOCK_N): 96 only with layout "qk"
QK_MAX_HEAD_DIM = 192    # 96 keys: dK^T + dV^T of 48 keys x head_dim rows per warpgroup fit its registers
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
    num_stages : depth of the Q/lse ring, and of dO/delta's unless ``do_stages`` (1 or 2; 2 fits every
        head dim up to 256; 3 where it fits, e.g. three Q stages beside one dO stage at d256 "kt").
    dq_mode : "red" - each thread adds its dQ fragments with 16-byte reductions (red.global.add.v4);
        "bulk" - each consumer warpgroup stages its half of the f32 dQ tile in shared memory and one
        thread adds it with a TMA bulk reduction (cp.reduce.async.bulk; +64 x head_dim x 4 B of
        shared memory: two ring stages fit up to head_dim 192).  Not with ``deterministic``.
        "ring" (two shared Q/dO stages) - the bulk reduction staged in the step's own Q/dO ring
        stage once both warpgroups have read it (warpgroup 0's half over the Q tile, 1's over dO;
        no staging tile: two stages fit at 96 keys, and with "kt" at every head dim up to 256);
        the stage returns to the producer when the reduction has read it, early in the next step.
        "kt" at head dims 152 and 216 gives each tile one more 32-column block (unloaded) so the
        wider warpgroup's f32 half fits it.
    layout : "kt" - keys are wgmma's M: S^T / dP^T split by queries, dK / dV by head-dim columns
        (P^T and dS^T cross between the warpgroups before dV and dK); "qk" - queries are wgmma's M
        (FlashAttention-3/4's sm90 choice at head dim 192): each consumer warpgroup owns
        key_block / 2 keys, computes S / dP for them and dK^T / dV^T = Q^T dS / dO^T P for them
        (head dim as M, no exchange before dV, dK), and only dQ = dS K reads the other's dS.
    key_block : keys per CTA: 64, or 96 with layout "qk" and head_dim <= 192 (dK^T + dV^T of 48
        keys x 192 head-dim rows: 144 registers per thread).
    do_stages : 0 - dO and delta share the Q ring's stages (one full / empty barrier pair per
        stage); 1 or 2 (dq_mode "red" or "bulk") - a separate dO / delta ring of that depth, so
        ``num_stages`` counts Q / lse stages only: FlashAttention-4's sm90 choice at head dim 192
        (two Q stages, one dO stage).  The next step's Q is then loaded a whole step ahead and
        its S (S^T) GEMM starts at once; the dO stage is released as soon as this step's dV^T
        (dV) GEMM has read it and refills behind the dK and dQ GEMMs.
    ds_buffers : dS buffers (2; 1 with layout "qk"): one buffer saves 2 x 8 KiB at 96 keys (what
        lets two Q stages, one dO stage and the f32 dQ staging tile fit together), at the cost of
        a one-way wait per step (a warpgroup rewrites its dS slice only after the other one's dQ
        GEMM of the previous step has read it).
    lpt_grid, stagger : as :class:`rtkernels.ops.attention_bwd_sm90.AttentionBwdSm90Config` (the
        heaviest-first causal grid, the non-causal walk from the diagonal; opt-in there, taken by
        :func:`choose_config` here).
    """

    family: ClassVar[str] = FAMILY
    template: ClassVar[str] = "attention_bwd_sm90_big.cu.j2"
    kernels: ClassVar[tuple[str, ...]] = ("attention_bwd_sm90_big", "attention_bwd_sm90_big_dot",
                                          "attention_bwd_sm90_big_dq_convert")
    tma_box_cols: ClassVar[int] = 32   # 64-byte swizzled column blocks (attention_bwd_sm90: 64, 128 B)
    tma_swizzle: ClassVar[int] = 64

    dq_mode: str = "red"
    layout: str = "kt"
    key_block: int = 64
    do_stages: int = 0
    ds_buffers: int = 2

    def __post_init__(self):
        self._check_shape()
        if not MIN_HEAD_DIM <= self.head_dim <= MAX_HEAD_DIM:
            self._fail("head_dim", f"a multiple of 8 in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}] (smaller head dims use "
                                   "attention_bwd_sm90)")
        self._check_choice("deterministic", (False, True))
        self._check_choice("num_stages", (1, 2, 3))
        self._check_choice("dq_mode", ("red", "bulk", "ring"))
        self._check_choice("layout", ("kt", "qk"))
        self._check_choice("key_block", _KEY_BLOCKS)
        self._check_choice("block_m", (_BLOCK_M,))   # 64 query rows per step (the template's BLOCK_M)
        if self.key_block != 64 and self.layout != "qk":
            self._fail("key_block", '64 with layout="kt" (its keys are one wgmma M of 64)')
        if self.key_block == 96 and self.head_dim > QK_MAX_HEAD_DIM:
            self._fail("key_block", "64 above head_dim 192 (dK^T + dV^T of 48 keys x 256 rows need 192 "
                                    "registers per thread before dQ's)")
        if self.dq_mode != "red" and self.deterministic:
            self._fail("dq_mode", '"red" with deterministic=True (the ordered flush adds from registers)')
        self._check_choice("do_stages", (0, 1, 2))
        if self.dq_mode == "ring" and (self.num_stages != 2 or self.do_stages):
            self._fail("dq_mode", '"red" or "bulk" unless num_stages=2 and do_stages=0 (the staging reuses the '
                                  'Q/dO stage a step has read while the other stage feeds the next step)')
        self._check_choice("ds_buffers", (1, 2))
        if self.ds_buffers != 2 and self.layout != "qk":
            self._fail("ds_buffers", '2 unless layout="qk" ("kt" alternates its P^T and dS^T buffers together)')
        self._check_grid_order()
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
        return self.key_block

    @property
    def split(self) -> int:
        return column_split(self.head_dim)

    @property
    def d_blocks(self) -> int:
        """32-column blocks per Q/dO/K/V tile: consumer 1 reads columns [split, split + the wider share)."""
        wide = max(self.split, self.head_dim - self.split)
        cols = -(-(self.split + wide) // 32)
        # layout "qk": dK^T / dV^T read Q^T / dO^T in 64-row wgmma atoms over the head dim
        atoms = 2 * -(-self.head_dim // 64) if self.layout == "qk" else 0
        # dq_mode "ring": a warpgroup's f32 half (64 rows x wide columns x 4 B) fits one tile
        ring = -(-wide // 16) if self.dq_mode == "ring" else 0
        return max(cols, atoms, ring)

    @property
    def pds_bytes(self) -> int:
        """One P^T / dS^T (or P / dS) buffer: 64 queries x block_n keys x 2 B; layout "qk" gives each
        warpgroup's key_block / 2 keys whole 32-key column blocks (64 B swizzled, 4 KiB each)."""
        if self.layout == "qk":
            return _CONSUMERS * -(-(self.key_block // _CONSUMERS) // 32) * _BLOCK_M * 64
        return self.key_block * 128

    @property
    def dout_stages(self) -> int:
        """Stages of dO and delta: do_stages, or the Q ring's num_stages when they share it."""
        return self.do_stages or self.num_stages

    @property
    def shared_mem_bytes(self) -> int:
        """K and V (key_block rows), num_stages x (Q tile of 64 rows + 64 lse values),
        dout_stages x (dO tile + 64 delta values), two P^T and ds_buffers dS^T buffers ("qk": one P
        buffer - only its own warpgroup reads it), the f32 dQ staging tile (dq_mode "bulk"), the
        mbarriers (kv, full / empty per stage, and per dO stage with a separate dO ring) and 1 KiB
        to align the base."""
        kv = 2 * self.d_blocks * self.key_block * 64
        tile = self.d_blocks * _BLOCK_M * 64 + _BLOCK_M * 4
        ring = (self.num_stages + self.dout_stages) * tile
        pds = ((1 if self.layout == "qk" else 2) + self.ds_buffers) * self.pds_bytes
        dq = _BLOCK_M * self.head_dim * 4 if self.dq_mode == "bulk" else 0
        bars = 8 * (1 + 2 * self.num_stages + 2 * self.do_stages)
        return kv + ring + pds + dq + bars + _ALIGN_SLACK

    def template_params(self) -> dict[str, Any]:
        p = super().template_params()
        p.update(split=self.split, block_n=self.block_n, dout_stages=self.dout_stages)
        return p

    @property
    def register_split(self) -> tuple[int, int]:
        """(producer, consumer) registers per thread after setmaxnreg: 24 / 240, the whole 168 x 384
        file (2 x (240 - 168) = 168 - 24).  The producer is one TMA-issuing thread with no dQ warp
        and fits 24; at 40 / 232 ptxas spilled 28 B at d248 causal deterministic (NVRTC 13.5), at
        24 / 240 no config spills, masked ones included (all three options at d256: clean)."""
        return (24, 240)


def choose_config(dtype: str, head_dim: int, causal: bool, deterministic: bool, **mask_flags) -> AttentionBwdSm90BigConfig:
    """The config the op runs (it cannot depend on the sequence length: one per dtype, head dim,
    causal, deterministic and mask options).

    Non-causal (neither deterministic nor masked) calls also take ``stagger``: each CTA walks its query
    tiles from its own diagonal tile, so a pair's key tiles - started together by the 3-D grid and
    equal in work - stop loading the same Q / dO tile and reducing into the same dQ tile at once;
    with it the ring dQ, which lost 0.84-0.93x alone (the stage is released a step later), wins at
    d200-256.  Measured (H100, 2026-11-26, bf16, FA4 and cuDNN in the same run, interleaved rounds,
    TFLOP/s at S 2k / 4k / 16k; tools/ab_bwd_s12.sh): d256 red 318 / 350 / 366 -> ring + stagger
    334 / 361 / 391 (stagger alone 322 / 351 / 382; cuDNN 346 / 386 / 349, FA4 291 / 304 / 314);
    d192 427 / 478 / 512 -> 427 / 483 / 547 (FA4 458 / 494 / 550).  Three Q stages beside one dO
    stage at d256 (red): 0.94-1.02x; not taken.

    head_dim <= 192, neither deterministic nor masked, causal or not: layout "qk", 96 keys per CTA,
    dQ by bulk reduction, FlashAttention-4's rings: two Q stages, one dO stage (its own barriers,
    released as soon as dV^T has read it) and one dS buffer (one shared ring of Q+dO with two
    stages and two dS buffers exceeds shared memory with the f32 dQ staging tile).  Measured
    (H200, 2026-11-26, bf16, FA4 and cuDNN in the same run, TFLOP/s at S 2k / 4k / 16k, old "qk" s1
    or causal "kt" -> these rings): d192 non-causal 357 / 385 / 446 -> 417 / 465 / 484 (FA4 418 /
    441 / 507), causal 290 / 359 / 426 -> 328 / 396 / 473 (FA4 302 / 389 / 488); the same rings
    with red dQ and two dS buffers 0.85-0.98x of FA4, 64 keys 0.67-0.82x.  Causal calls also take
    lpt_grid (a 1-D grid, heaviest key tiles first in L2-sized sections): d192 S 2k / 4k 324 / 351
    -> 334 / 419 TFLOP/s (H200, same day, --alt lpt_grid=true).

    Causal head dims 200-256: "kt" with the dQ halves reduced from the step's own Q / dO stage
    (dq_mode "ring": two stages and a bulk reduction fit together) and lpt_grid.  Measured (H200,
    2026-11-26, cuDNN in the same run, d256 S 2k / 4k / 16k): red 266 / 309 / 359 -> ring + lpt
    286 / 331 / 381 (cuDNN 279 / 314 / 388); ring alone 265 / 305 / 353, lpt alone 275 / 320 /
    361.  (Non-causal d256: ring 0.84-0.93x of red without stagger; with it, see above.)
    The text below is the history of the choice before them.

    Non-causal, head_dim <= 192 (session 9): layout "qk", 96 keys per CTA,
    dQ by bulk reduction, one ring stage (two and the f32 staging tile exceed shared memory).
    Measured (H200, 2026-11-26, bf16, FlashAttention's grid, TFLOP/s at S 2k / 4k / 16k,
    tools/bench_attention_bwd.py --alt): d192 "kt" 64 keys s2 bulk 366 / 408 / 424, "qk" 96 s1
    bulk 366 / 406 / 452 (1.00 / 1.00 / 1.07x), "qk" 96 s2 red 340 / 392 / 435, "qk" 64 s2 bulk
    355 / 372 / 419.  ptxas (NVRTC 13.5): 168 registers, no spills at 136..192, both dtypes.
    Causal keeps "kt": "qk" 96 s1 bulk lost 7-16% there (254 / 282 / 357 vs 272 / 335 / 409: the
    causal CTAs walk half as many query tiles on average, so the one-stage ring's exposed Q/dO
    load per step and the prologue weigh more), and "qk" 96 s2 red was 1.05 / 0.97 / 1.02x - a
    3.3% loss at 4k (the issue allows 3% against today's) for +1-5% elsewhere, within a single
    run's spread.  Deterministic and masked calls keep "kt" too: the ordered flush needs the
    register reductions ("qk" s2 red is unmeasured deterministic) and "qk"'s masked builds spill
    (48 B, NVRTC 13.5).

    Otherwise ("kt", 64 keys): two ring stages (the next tile's 64 KiB of Q/dO at d256 land while
    this one computes; it fits up to d256: 226 KiB).  dQ: the bulk reduction where two stages
    still fit it and the call is neither deterministic nor masked, else the threads' 16-byte
    reductions.  Measured (H100, 2026-11-25, bf16, TFLOP/s red / bulk, --alt dq_mode=bulk): d192
    S 4k / 16k non-causal 318 / 366, 351 / 398; causal 282 / 318, 347 / 391 (+13%: one TMA
    reduction per tile instead of 64 x head_dim / 4 red.global ops through L2); d256 bulk fits
    one stage only: non-causal 342 / 342, 364 / 374, causal 288 / 253, 368 / 289."""
    cfg = AttentionBwdSm90BigConfig(dtype=dtype, head_dim=head_dim, causal=causal, deterministic=deterministic,
                                    num_stages=2, **mask_flags)
    if deterministic or any(mask_flags.values()):
        return cfg
    if head_dim <= QK_MAX_HEAD_DIM:
        return cfg.replace(layout="qk", key_block=96, dq_mode="bulk", num_stages=2, do_stages=1, ds_buffers=1,
                           lpt_grid=causal, stagger=not causal)
    if causal:
        return cfg.replace(dq_mode="ring", lpt_grid=True)
    return cfg.replace(dq_mode="ring", stagger=True)


def heuristic_configs(dtypes=("float16", "bfloat16")) -> list[AttentionBwdSm90BigConfig]:
    """Every unmasked config the op can dispatch to."""
    return [choose_config(dt, d, c, det) for dt in dtypes for d in range(MIN_HEAD_DIM, MAX_HEAD_DIM + 1, 8)
            for c in (False, True) for det in (False, True)]
