"""attention_bwd_sm90_big: the Hopper backward for head dims 136..256 (templates/attention_bwd_sm90_big.cu.j2)
behind rtk.attention_backward on sm_90.

CPU: config validation and derived values (column split, tile blocks, shared memory), the dispatch
rule (attention_bwd_sm90.picks / choose_config send 136..256 here), a model of the head-dim split
and of the dQ reductions' addresses (every column of dK/dV/dQ written by exactly one warpgroup,
every operand read inside its tile), the chosen configs compile for sm_90a without spills or local
memory, and the SASS holds the HGMMAs, TMA loads (UTMALDG) and 16-byte dQ reductions it is built on.
GPU (``-m gpu``, sm_90 only): tests/test_attention_bwd.py's reference and 2x error rule through this
kernel explicitly: head dims 136..256, odd seqlens (1, 77, 1000) with seqlen_q != seqlen_k, causal,
GQA/MQA, strided views and a custom scale, windows and softcap, deterministic runs bit-identical
(and, varlen with window + softcap, tests/test_attention_varlen.py's runner).
"""
from __future__ import annotations

import pytest

import rtkernels as rtk
from rtkernels.errors import ConfigError
from rtkernels.ops import attention_bwd_sm90 as B90
from rtkernels.ops import attention_bwd_sm90_big as BIG
from rtkernels.ops.attention_bwd_sm90_big import AttentionBwdSm90BigConfig

import test_attention_bwd as bwd_tests   # the backward's GPU case runner (tests/ is on sys.path)

HEAD_DIMS = list(range(136, 257, 8))
CHECKED_DIMS = [136, 144, 176, 192, 200, 248, 256]   # compiled on the CPU, causal and not


@pytest.mark.parametrize("bad", [dict(head_dim=128), dict(head_dim=264), dict(head_dim=140), dict(dtype="float32"),
                                 dict(num_stages=4), dict(num_stages=3, head_dim=256), dict(deterministic="yes"),
                                 dict(dq_mode="atomic"),
                                 dict(dq_mode="bulk", deterministic=True), dict(head_dim=256, dq_mode="bulk"),
                                 dict(layout="kq"), dict(key_block=96), dict(key_block=128, layout="qk"),
                                 dict(key_block=96, layout="qk", head_dim=200),
                                 dict(do_stages=1, dq_mode="ring"), dict(ds_buffers=1), dict(do_stages=3, layout="qk"),
                                 dict(ds_buffers=3, layout="qk"),
                                 dict(do_stages=1, layout="qk", key_block=96, dq_mode="ring", num_stages=2),
                                 dict(dq_mode="ring", num_stages=1), dict(lpt_grid=True),
                                 dict(lpt_grid=True, causal=True, deterministic=True),
                                 dict(lpt_grid=True, causal=True, is_varlen=True), dict(lpt_grid="yes", causal=True)])
def test_config_rejects(bad):
    with pytest.raises(ConfigError) as e:
        AttentionBwdSm90BigConfig(**{"head_dim": 192, **bad})
    assert "attention_bwd_sm90_big" in str(e.value) and next(iter(bad)) in str(e.value)


def test_config_derived_values():
    c = AttentionBwdSm90BigConfig(dtype="bf16", head_dim=256)
    assert c.split == 128 and c.d_blocks == 8 and c.block_n == 64 and c.threads_per_block == 384
    # K, V 64 rows x 8 blocks x 64 B; 2 stages x (Q, dO 64 x 8 x 64 B + lse, delta 2 x 256 B);
    # P^T, dS^T 2 buffers each of 64 x 128 B; 5 barriers; 1 KiB slack
    assert c.shared_mem_bytes == 2 * 64 * 8 * 64 + 2 * (2 * 64 * 8 * 64 + 512) + 4 * 64 * 128 + 8 * 5 + 1024
    assert rtk.families()["attention_bwd_sm90_big"] is AttentionBwdSm90BigConfig
    assert AttentionBwdSm90BigConfig.needs_arch_specific
    assert [BIG.column_split(d) for d in (136, 176, 192, 200, 248)] == [64, 96, 96, 96, 128]
    for cfg in BIG.heuristic_configs(("bfloat16",)):
        # two stages everywhere ("qk": two Q stages beside one dO stage and one dS buffer)
        assert cfg.shared_mem_bytes <= B90.SMEM_LIMIT_SM90 and cfg.num_stages == 2, cfg
        assert (cfg.do_stages, cfg.ds_buffers) == ((1, 1) if cfg.layout == "qk" else (0, 2)), cfg


def test_choose_config_rule():
    """Head dims <= 192, causal or not, neither deterministic nor masked: "qk", 96 keys, bulk dQ,
    FA4's rings (two Q stages, one dO stage, one dS buffer); d200-256 "kt" with the ring dQ;
    everything else "kt" with 64 keys and two stages (red dQ).  Non-deterministic: lpt_grid when
    causal, stagger when not."""
    for d in HEAD_DIMS:
        for causal in (False, True):
            for det in (False, True):
                cfg = BIG.choose_config("bfloat16", d, causal, det)
                assert cfg.lpt_grid == (causal and not det), cfg
                assert cfg.stagger == (not causal and not det), cfg
                if not det and d <= 192:
                    assert (cfg.layout, cfg.key_block, cfg.dq_mode, cfg.num_stages, cfg.do_stages, cfg.ds_buffers) \
                        == ("qk", 96, "bulk", 2, 1, 1), cfg
                else:
                    assert (cfg.layout, cfg.key_block, cfg.num_stages) == ("kt", 64, 2), cfg
                    assert cfg.dq_mode == ("red" if det else "ring"), cfg
    for flag in ("has_window", "has_softcap", "is_varlen"):
        cfg = BIG.choose_config("float16", 176, False, False, **{flag: True})
        assert (cfg.layout, cfg.key_block, cfg.dq_mode, cfg.stagger) == ("kt", 64, "red", False), (flag, cfg)
    assert B90.choose_config("bfloat16", 192, False, False) == BIG.choose_config("bfloat16", 192, False, False)


def test_qk_layout_derived_values():
    """Layout "qk" at d192, 96 keys: K, V 96 rows x 6 blocks; P (one buffer) and dS (two) of 2
    warpgroups x 2 32-key blocks x 4 KiB; two ring stages fit only with dQ's register reductions.
    d136 reads Q^T / dO^T in 3 whole 64-row atoms: 6 blocks (5 for "kt")."""
    c = AttentionBwdSm90BigConfig(head_dim=192, layout="qk", key_block=96)
    assert c.block_n == 96 and c.d_blocks == 6 and c.pds_bytes == 2 * 2 * 4096
    assert c.shared_mem_bytes == 2 * 96 * 6 * 64 + 2 * (2 * 64 * 6 * 64 + 512) + 3 * 16384 + 8 * 5 + 1024
    with pytest.raises(ConfigError):
        c.replace(dq_mode="bulk")   # two stages + the f32 staging tile: 272 KiB
    assert c.replace(dq_mode="bulk", num_stages=1).shared_mem_bytes <= B90.SMEM_LIMIT_SM90
    assert AttentionBwdSm90BigConfig(head_dim=136, layout="qk", key_block=96).d_blocks == 6
    assert AttentionBwdSm90BigConfig(head_dim=136).d_blocks == 5
    assert AttentionBwdSm90BigConfig(head_dim=256, layout="qk", num_stages=2).pds_bytes == 2 * 4096


def test_qk_layout_compiles_clean():
    """One "qk" build (d192, 96 keys, bulk dQ, one stage): no spills, per step S and dP 2 x 12
    k-steps, dV^T and dK^T 2 x (3 atoms x 4 k-steps), dQ 6 k-steps of HGMMA, one bulk reduction."""
    from rtkernels.kernel import get_kernel
    cfg = AttentionBwdSm90BigConfig(dtype="bfloat16", head_dim=192, layout="qk", key_block=96, dq_mode="bulk",
                                    num_stages=1)
    k = get_kernel(cfg, arch="sm_90a")
    r = k.resources
    assert not (r.spill_stores or r.spill_loads or r.stack_frame), r
    assert not [line for line in k.module.log.splitlines() if "wgmma" in line]
    assert k.sass.count("HGMMA.") == 2 * 12 + 2 * 3 * 4 + 6
    assert "UBLKRED" in k.sass and "UTMALDG" in k.sass


SPLIT_RING = dict(layout="qk", key_block=96, num_stages=2, do_stages=1, ds_buffers=1, dq_mode="bulk")


def test_qk_split_ring_shared_memory():
    """FlashAttention-4's d192 rings (two Q stages, one dO stage) with the bulk dQ reduction fit at
    96 keys only with one dS buffer (d192: 231224 of 232448 B); with two they exceed it; the red
    reduction fits either way.  do_stages=0 keeps the shared ring's byte count."""
    c = AttentionBwdSm90BigConfig(head_dim=192, **SPLIT_RING)
    assert c.dout_stages == 1
    tile = 6 * 64 * 64 + 64 * 4
    assert c.shared_mem_bytes == (2 * 96 * 6 * 64 + 3 * tile + 2 * 16384 + 64 * 192 * 4 + 8 * (1 + 4 + 2)
                                  + 1024) <= B90.SMEM_LIMIT_SM90
    with pytest.raises(ConfigError, match="num_stages"):
        c.replace(ds_buffers=2)
    assert c.replace(ds_buffers=2, dq_mode="red").shared_mem_bytes <= B90.SMEM_LIMIT_SM90
    for d in (136, 176):
        assert c.replace(head_dim=d).shared_mem_bytes <= B90.SMEM_LIMIT_SM90
    base = AttentionBwdSm90BigConfig(head_dim=192, layout="qk", key_block=96, num_stages=1, dq_mode="bulk")
    assert base.dout_stages == 1 and base.shared_mem_bytes == c.replace(
        num_stages=1, do_stages=0, ds_buffers=2).shared_mem_bytes


def test_qk_split_ring_builds_clean():
    """The split-ring build (d192 causal, bulk dQ, one dS buffer): no spills, the same 54 HGMMA per
    step as the shared ring, one bulk reduction, no register reductions, no serialized wgmma."""
    from rtkernels.kernel import get_kernel
    k = get_kernel(AttentionBwdSm90BigConfig(dtype="bfloat16", head_dim=192, causal=True, **SPLIT_RING),
                   arch="sm_90a")
    r = k.resources
    assert not (r.spill_stores or r.spill_loads or r.stack_frame), r
    assert not [line for line in k.module.log.splitlines() if "wgmma" in line]
    assert k.sass.count("HGMMA.") == 54 and k.sass.count("UBLKRED") == 1 and "REDG" not in k.sass


def test_qk_ring_mode_config_and_build():
    """dq_mode="ring" (the bulk dQ reduction staged in the step's own Q/dO stage): two stages and 96
    keys fit with it at d192 (no staging tile); two shared stages only, never deterministic; the
    build has no spills, one bulk reduction and no register reductions."""
    from rtkernels.kernel import get_kernel
    c = AttentionBwdSm90BigConfig(dtype="bfloat16", head_dim=192, causal=True, layout="qk", key_block=96,
                                  dq_mode="ring", num_stages=2)
    assert c.shared_mem_bytes == c.replace(dq_mode="red").shared_mem_bytes <= B90.SMEM_LIMIT_SM90
    for bad in (dict(do_stages=1), dict(num_stages=1), dict(deterministic=True)):
        with pytest.raises(ConfigError):
            c.replace(**bad)
    k = get_kernel(c, arch="sm_90a")
    r = k.resources
    assert not (r.spill_stores or r.spill_loads or r.stack_frame), r
    assert not [line for line in k.module.log.splitlines() if "wgmma" in line]
    assert k.sass.count("UBLKRED") == 1 and "REDG" not in k.sass and k.sass.count("HGMMA.") == 54


def test_column_split_model():
    """The template's split: consumer w computes head-dim columns [c_w, c_w + DN) from 32-column
    blocks and keeps [c_w, c_end_w); together every column exactly once, no operand read past
    the tile's blocks, and the dQ reduction addresses (dq_tile_index of register c_w / 2 + i)
    cover each 64 x d tile slot exactly once."""
    for d in HEAD_DIMS:
        cfg = AttentionBwdSm90BigConfig(head_dim=d)
        split = cfg.split
        dn = max(split, d - split)
        assert split % 32 == 0 and dn % 8 == 0 and abs(split - (d - split)) <= 32, d
        kept, slots = [], []
        for w, (c0, c_end) in enumerate(((0, split), (split, d))):
            assert c0 + dn <= 32 * cfg.d_blocks, d          # N-major reads stay in the tile
            assert c_end - c0 <= dn
            kept += range(c0, c_end)
            for tid in range(128):
                for i in range(0, dn // 2, 4):
                    if c0 + 2 * i < c_end:
                        base = (c0 // 2 + i) // 4 * 512 + tid * 4
                        slots += range(base, base + 4)
        assert kept == list(range(d)), d
        assert sorted(slots) == list(range(64 * d)), d
        assert 16 * -(-d // 16) <= 32 * cfg.d_blocks          # S^T's k-steps over the head dim


def test_dispatch_rule_sends_big_head_dims_here(monkeypatch):
    class V:
        strides, shape = (1 << 20, 4096, 256, 2), (4, 512, 16, 192)
    for d in HEAD_DIMS:
        assert B90.picks(d, False) and B90.picks(d, True) and B90.eligible("sm_90", (V(),), 100, d)
        assert isinstance(B90.choose_config("bfloat16", d, True, True), AttentionBwdSm90BigConfig)
    assert not B90.eligible("sm_80", (V(),), 100, 192)
    assert type(B90.choose_config("bfloat16", 128, False, False)) is B90.AttentionBwdSm90Config
    monkeypatch.setattr(BIG, "ENABLED", False)
    assert not B90.picks(192, False) and B90.picks(128, False)
    monkeypatch.setattr(BIG, "ENABLED", True)
    monkeypatch.setattr(B90, "ENABLED", False)
    assert not B90.picks(192, False)


@pytest.fixture(scope="module")
def built():
    """The main kernel of every CHECKED_DIMS config (causal and not; deterministic on every other),
    compiled once for the tests below (about 1 s each)."""
    from rtkernels.kernel import get_kernel
    out = {}
    for i, d in enumerate(CHECKED_DIMS):
        for causal in (False, True):
            det = (i + causal) % 2 == 1
            cfg = B90.choose_config(("float16", "bfloat16")[i % 2], d, causal, det)
            out[(d, causal)] = (cfg, get_kernel(cfg, arch="sm_90a"))
    return out


def test_chosen_configs_compile_without_spills(built):
    """No spills beyond loop bookkeeping, and no wgmma pipeline serialized by ptxas (C7514-C7517: an
    accumulator touched by ordinary instructions while its wgmma is in flight, or a wait the compiler
    had to inject).  NVRTC 13.5 spills nothing; NVRTC 13.0 (the GPU host's, 2026-11-25) spills one or
    two loop integers at head dims 224-248 (4-8 B: one STL and two LDL per 64-query step, beside
    ~100 HGMMA), which B90.bookkeeping_spill_only tolerates."""
    for (d, causal), (cfg, k) in built.items():
        r = k.resources
        assert B90.bookkeeping_spill_only(r), (d, causal, cfg.deterministic, r)
        notes = [line for line in k.module.log.splitlines() if "wgmma" in line]
        assert not notes, (d, causal, notes)


@pytest.mark.parametrize("d,causal", [(136, True), (192, False), (256, True)])
def test_sass_has_wgmma_tma_and_reductions(built, d, causal):
    cfg, k = built[(d, causal)]
    sass = k.sass
    # per step: S^T and dP^T over the head dim (16-column k-steps), dV, dK over 64 queries, dQ over 64 keys
    assert sass.count("HGMMA.") == 2 * -(-d // 16) + 3 * 4, (d, causal)
    dn = max(cfg.split, d - cfg.split)
    reds = [line for line in sass.splitlines() if "REDG.E.ADD.F32x4" in line]
    assert len(reds) == dn // 8, (d, len(reds))       # one 16-byte reduction per 8-column block
    assert "UTMALDG" in sass and "LDL" not in sass and "STL" not in sass


def test_dq_bulk_mode_compiles_to_bulk_reductions():
    from rtkernels.kernel import get_kernel
    cfg = AttentionBwdSm90BigConfig(dtype="bfloat16", head_dim=192, causal=True, num_stages=2, dq_mode="bulk")  # "kt"
    assert cfg.shared_mem_bytes == AttentionBwdSm90BigConfig(head_dim=192).shared_mem_bytes + 64 * 192 * 4
    k = get_kernel(cfg, arch="sm_90a")
    r = k.resources
    assert not (r.spill_stores or r.spill_loads or r.stack_frame), r
    assert "UBLKRED" in k.sass and "REDG.E.ADD.F32x4" not in k.sass


def test_dq_convert_and_dot_compile_clean():
    from rtkernels.kernel import get_kernel
    cfg = B90.choose_config("bfloat16", 256, True, False)
    for name in cfg.kernels[1:]:
        k = get_kernel(cfg, name, arch="sm_90a")
        r = k.resources
        assert not (r.spill_stores or r.spill_loads or r.stack_frame), (name, r)
    assert "STG.E.128" in get_kernel(cfg, "attention_bwd_sm90_big_dq_convert", arch="sm_90a").sass


# ---- GPU -------------------------------------------------------------------------------------
def _require_sm90():
    from rtkernels.ops.attention import _device_arch
    import cupy as cp
    if not B90.is_sm90(_device_arch(cp.cuda.runtime.getDevice())):
        pytest.skip("the Hopper backward needs an sm_90 device")


def _case(*args, **kw):
    """bwd_tests._gpu_case through this kernel (its config given explicitly: a silent fall-back to
    the mma.sync kernel cannot pass for it)."""
    _require_sm90()
    batch, sq, sk, h, hkv, d, causal, dtype = args
    cfg = BIG.choose_config(dtype, d, causal, kw.get("deterministic", False))
    print(f"case batch={batch} sq={sq} sk={sk} h={h}/{hkv} d={d} causal={causal} {dtype} {kw}")
    return bwd_tests._gpu_case(*args, **kw, hopper=cfg)


GPU_DIMS = [136, 144, 176, 200, 248, 256]


@pytest.mark.gpu
@pytest.mark.parametrize("d", GPU_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_head_dims(d, causal):
    dtype = ("float16", "bfloat16")[(d // 8 + causal) % 2]
    _case(2, 113, 203, 4, 2, d, causal, dtype, deterministic=(d % 3 == 0))


@pytest.mark.gpu
@pytest.mark.parametrize("sq,sk", [(1, 1), (1, 77), (77, 1), (77, 77), (1000, 77), (77, 1000), (1000, 1000)])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_odd_seqlens(sq, sk, causal):
    d = 192 if (sq + sk) % 2 else 256
    _case(1, sq, sk, 2, 1, d, causal, "bfloat16" if causal else "float16")


GPU_COMBINED = [   # batch, sq, sk, h, hkv, d, causal, dtype, deterministic
    (3, 255, 255, 16, 2, 192, True, "bfloat16", False),    # GQA 8:1
    (2, 113, 1000, 8, 1, 256, False, "float16", True),     # MQA, deterministic
    (1, 1000, 255, 8, 1, 176, True, "float16", False),     # MQA, causal rows that see no key
    (1, 2048, 2048, 2, 2, 200, True, "bfloat16", True),
    (2, 17, 4097, 4, 1, 256, True, "float16", False),
    (1, 4097, 1000, 2, 1, 136, True, "bfloat16", True),
    (2, 300, 301, 4, 2, 224, False, "bfloat16", False),    # d160, d224: a tile block past the head dim
    (1, 301, 300, 2, 1, 160, True, "float16", True),       # is never loaded (LOAD_BLOCKS)
]


@pytest.mark.gpu
@pytest.mark.parametrize("batch,sq,sk,h,hkv,d,causal,dtype,det", GPU_COMBINED)
def test_gpu_combined(batch, sq, sk, h, hkv, d, causal, dtype, det):
    _case(batch, sq, sk, h, hkv, d, causal, dtype, deterministic=det)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,sq,sk,h,hkv,d,causal,dtype", [
    (2, 113, 203, 4, 2, 136, True, "bfloat16"), (1, 1000, 77, 2, 1, 176, False, "float16"),
    (3, 255, 255, 16, 2, 192, True, "bfloat16"), (1, 77, 1000, 2, 2, 192, False, "float16")])
def test_gpu_dq_bulk_mode(batch, sq, sk, h, hkv, d, causal, dtype):
    """dq_mode="bulk": dQ halves staged in shared memory and added by TMA bulk reductions."""
    _require_sm90()
    cfg = BIG.choose_config(dtype, d, causal, False).replace(dq_mode="bulk")
    bwd_tests._gpu_case(batch, sq, sk, h, hkv, d, causal, dtype, hopper=cfg)


QK_CASES = [   # batch, sq, sk, h, hkv, d, causal, dtype, key_block, dq_mode, num_stages, deterministic
    (3, 255, 255, 16, 2, 192, True, "bfloat16", 96, "bulk", 1, False),   # GQA 8:1
    (2, 113, 1000, 8, 1, 192, False, "float16", 96, "red", 2, True),     # MQA, deterministic
    (1, 1000, 255, 8, 1, 176, True, "float16", 96, "bulk", 1, False),    # causal rows that see no key
    (2, 300, 301, 4, 2, 160, False, "bfloat16", 96, "red", 2, False),    # a block past the head dim
    (1, 4097, 1000, 2, 1, 136, True, "bfloat16", 96, "red", 2, True),
    (1, 77, 77, 2, 1, 192, True, "float16", 64, "bulk", 2, False),
    (2, 17, 4097, 4, 1, 256, True, "float16", 64, "red", 2, False),
    (1, 1000, 1000, 2, 2, 248, False, "bfloat16", 64, "red", 2, True),
    # dq_mode "ring": dQ staged in the step's own Q/dO stage (GQA, odd lengths, many steps per CTA)
    (3, 255, 255, 16, 2, 192, True, "bfloat16", 96, "ring", 2, False),
    (1, 1000, 255, 8, 1, 176, True, "float16", 96, "ring", 2, False),
    (2, 113, 1000, 8, 1, 136, False, "float16", 96, "ring", 2, False),
    (1, 2048, 2048, 2, 1, 192, False, "bfloat16", 96, "ring", 2, False),
    (2, 17, 4097, 4, 1, 256, True, "float16", 64, "ring", 2, False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("batch,sq,sk,h,hkv,d,causal,dtype,kb,dq_mode,stages,det", QK_CASES)
def test_gpu_qk_layout(batch, sq, sk, h, hkv, d, causal, dtype, kb, dq_mode, stages, det):
    """layout="qk" (queries as wgmma M; 96 keys per CTA at d <= 192) against the float64 reference."""
    _require_sm90()
    cfg = AttentionBwdSm90BigConfig(dtype=dtype, head_dim=d, causal=causal, deterministic=det, layout="qk",
                                    key_block=kb, dq_mode=dq_mode, num_stages=stages)
    print(f"qk case batch={batch} sq={sq} sk={sk} h={h}/{hkv} d={d} causal={causal} {dtype} {cfg}")
    bwd_tests._gpu_case(batch, sq, sk, h, hkv, d, causal, dtype, deterministic=det, hopper=cfg)


SPLIT_RING_CASES = [   # batch, sq, sk, h, hkv, d, causal, dtype, key_block, dq_mode, ds_buffers, deterministic
    (3, 255, 255, 16, 2, 192, True, "bfloat16", 96, "bulk", 1, False),   # GQA 8:1, causal
    (1, 2048, 2048, 2, 1, 192, False, "bfloat16", 96, "bulk", 1, False),  # many steps per CTA
    (1, 1000, 255, 8, 1, 176, True, "float16", 96, "bulk", 1, False),    # causal rows that see no key
    (2, 113, 1000, 8, 1, 136, False, "float16", 96, "bulk", 1, False),   # MQA, odd lengths
    (1, 77, 77, 2, 1, 192, True, "float16", 96, "bulk", 1, False),       # one step per CTA
    (2, 300, 301, 4, 2, 160, True, "bfloat16", 96, "red", 2, False),     # a block past the head dim
    (2, 113, 1000, 8, 1, 192, False, "float16", 96, "red", 1, True),     # deterministic, one dS buffer
    (1, 4097, 1000, 2, 1, 200, True, "bfloat16", 64, "red", 1, True),    # 64 keys above d192
    (2, 17, 4097, 4, 1, 256, True, "float16", 64, "red", 1, False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("batch,sq,sk,h,hkv,d,causal,dtype,kb,dq_mode,ds_bufs,det", SPLIT_RING_CASES)
def test_gpu_qk_split_ring(batch, sq, sk, h, hkv, d, causal, dtype, kb, dq_mode, ds_bufs, det):
    """layout="qk" with a separate one-stage dO ring beside two Q stages (do_stages=1) and one or
    two dS buffers, against the float64 reference (the 2x error rule)."""
    _require_sm90()
    cfg = AttentionBwdSm90BigConfig(dtype=dtype, head_dim=d, causal=causal, deterministic=det, layout="qk",
                                    key_block=kb, dq_mode=dq_mode, num_stages=2, do_stages=1, ds_buffers=ds_bufs)
    print(f"split-ring case batch={batch} sq={sq} sk={sk} h={h}/{hkv} d={d} causal={causal} {dtype} {cfg}")
    bwd_tests._gpu_case(batch, sq, sk, h, hkv, d, causal, dtype, deterministic=det, hopper=cfg)


@pytest.mark.gpu
def test_gpu_qk_split_ring_deterministic_is_bit_identical():
    import cupy as cp
    _require_sm90()
    cfg = AttentionBwdSm90BigConfig(dtype="bfloat16", head_dim=192, causal=True, deterministic=True, layout="qk",
                                    key_block=96, num_stages=2, do_stages=1, ds_buffers=1)
    a, b = (bwd_tests._gpu_case(2, 700, 900, 4, 2, 192, True, "bfloat16", deterministic=True, seed=11, hopper=cfg)
            for _ in range(2))
    for name, x, y in zip(("dq", "dk", "dv"), a, b):
        diff = x.view(cp.uint16) != y.view(cp.uint16)
        assert not bool(diff.any()), f"qk split ring d192 causal: {name} differs at {int(diff.sum())} elements"


@pytest.mark.gpu
def test_gpu_host_nvrtc_builds_split_ring_clean():
    """The split-ring configs the op dispatches (d136 and d192, causal and not, bulk dQ with one dS
    buffer) built by the GPU host's NVRTC: no spill beyond loop bookkeeping, no serialized wgmma.
    (Red dQ with two dS buffers, an A/B column only, spills 16 B at d192 causal under NVRTC 13.0:
    H200 run, 2026-11-26.)"""
    _require_sm90()
    from rtkernels.kernel import get_kernel
    bad = []
    for d in (136, 192):
        for causal in (False, True):
            for extra in (dict(dq_mode="bulk", ds_buffers=1),):
                cfg = AttentionBwdSm90BigConfig(dtype="bfloat16", head_dim=d, causal=causal, layout="qk", key_block=96,
                                                num_stages=2, do_stages=1, **extra)
                k = get_kernel(cfg, arch="sm_90a")
                notes = [line for line in k.module.log.splitlines() if "wgmma" in line]
                print(d, causal, extra, k.resources, len(notes))
                if not B90.bookkeeping_spill_only(k.resources) or notes:
                    bad.append((d, causal, extra, k.resources, notes))
    assert not bad, bad


@pytest.mark.gpu
def test_gpu_qk_deterministic_is_bit_identical():
    import cupy as cp
    _require_sm90()
    cfg = AttentionBwdSm90BigConfig(dtype="bfloat16", head_dim=192, causal=True, deterministic=True, layout="qk",
                                    key_block=96)
    a, b = (bwd_tests._gpu_case(2, 700, 900, 4, 2, 192, True, "bfloat16", deterministic=True, seed=11, hopper=cfg)
            for _ in range(2))
    for name, x, y in zip(("dq", "dk", "dv"), a, b):
        diff = x.view(cp.uint16) != y.view(cp.uint16)
        assert not bool(diff.any()), f"qk d192 causal: {name} differs at {int(diff.sum())} elements"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d", [("float16", 200), ("bfloat16", 256)])
def test_gpu_strided_inputs_and_custom_scale(dtype, d):
    _case(2, 333, 333, 4, 4, d, True, dtype, softmax_scale=0.3, strided=True)


@pytest.mark.gpu
@pytest.mark.parametrize("d,causal,hkv", [(192, False, 2), (256, True, 1), (144, True, 4)])
def test_gpu_deterministic_is_bit_identical(d, causal, hkv):
    import cupy as cp
    a = _case(2, 700, 900, 4, hkv, d, causal, "bfloat16", deterministic=True, seed=11)
    b = _case(2, 700, 900, 4, hkv, d, causal, "bfloat16", deterministic=True, seed=11)
    for name, x, y in zip(("dq", "dk", "dv"), a, b):
        diff = x.view(cp.uint16) != y.view(cp.uint16)
        assert not bool(diff.any()), f"d={d} causal={causal} hkv={hkv}: {name} differs at {int(diff.sum())} elements"


@pytest.mark.gpu
@pytest.mark.parametrize("d,causal,window,softcap", [(192, False, (100, 30), None), (256, True, None, 30.0),
                                                     (136, False, (64, 64), 50.0)])
def test_gpu_window_and_softcap(d, causal, window, softcap):
    """Dense windows / softcap, seqlen_q != seqlen_k both ways, through the default dispatch (the
    masked build is picked when ptxas reports it clean; asserted below)."""
    _require_sm90()
    import cupy as cp
    from gpu_util import poison, random_array, to_f64
    from rtkernels.ops.attention import attention
    from rtkernels.ops.attention_bwd import attention_backward, attention_backward_reference
    flags = (("has_window", window is not None), ("has_softcap", softcap is not None), ("is_varlen", False))
    assert B90.picks(d, causal, flags, "bfloat16", False), "the masked build spills: the op would not pick it"
    import numpy as np
    rng = np.random.default_rng(5)
    for sq, sk in ((300, 517), (517, 300)):
        q = random_array(rng, (2, sq, 4, d), "bfloat16")[0]
        k = random_array(rng, (2, sk, 2, d), "bfloat16")[0]
        v = random_array(rng, (2, sk, 2, d), "bfloat16")[0]
        do = random_array(rng, q.shape, "bfloat16")[0]
        o, lse = attention(q, k, v, causal=causal, window=window, softcap=softcap, dtype="bfloat16")
        grads = [poison(cp.empty(a.shape, a.dtype)) for a in (q, k, v)]
        attention_backward(do, q, k, v, o, lse, causal=causal, window=window, softcap=softcap, dq=grads[0],
                           dk=grads[1], dv=grads[2], dtype="bfloat16")
        cp.cuda.get_current_stream().synchronize()
        mask = dict(causal=causal, window=window, softcap=softcap)
        ref = attention_backward_reference(do, q, k, v, dtype="bfloat16", compute="float64", **mask)
        low = attention_backward_reference(do, q, k, v, dtype="bfloat16", compute="float32", round_to="bfloat16",
                                           **mask)
        for name, got, r, lo in zip(("dq", "dk", "dv"), grads, ref, low):
            g64 = cp.asarray(to_f64(got, "bfloat16"))
            assert not bool(cp.isnan(g64).any()), f"sq={sq} sk={sk} {mask}: {name} NaN"
            err, err_low = bwd_tests._rel_gpu(g64, r), bwd_tests._rel_gpu(lo, r)
            assert err <= 2 * err_low + 2 ** -7, f"sq={sq} sk={sk} d={d} {mask}: {name} rel err {err:.3e} vs " \
                                                 f"reference-in-bf16 {err_low:.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d,det", [("float16", 192, False), ("bfloat16", 256, True), ("bfloat16", 152, False)])
def test_gpu_varlen_window_softcap(dtype, d, det):
    """Packed sequences (lengths 0, 1, 17, 128, 200, ...), causal with a window and a softcap, GQA:
    tests/test_attention_varlen.py's case runner through the default dispatch (this kernel where
    the masked build is clean, asserted)."""
    _require_sm90()
    import numpy as np
    import test_attention_varlen as vl_tests
    flags = (("has_window", True), ("has_softcap", True), ("is_varlen", True))
    assert B90.picks(d, True, flags, dtype, det), "the masked build spills: the op would not pick it"
    rng = np.random.default_rng(d)
    vl_tests._varlen_backward(rng, vl_tests.SHORT_Q, vl_tests.SHORT_K, 6, 2, d, dtype, True, (100, 0), 30.0,
                              deterministic=det)


@pytest.mark.gpu
def test_gpu_host_nvrtc_builds_dispatched_qk_clean():
    """The "qk" configs the op dispatches (non-causal, head dims 136..192, both dtypes) built by this
    host's NVRTC (13.0 on the GPU machine spilled more than the CPU's 13.5 in earlier sessions): no
    spill beyond loop bookkeeping, no serialized wgmma pipeline."""
    _require_sm90()
    from rtkernels.kernel import get_kernel
    bad = []
    for dt in ("float16", "bfloat16"):
        for d in range(136, 193, 8):
            cfg = BIG.choose_config(dt, d, False, False)
            assert cfg.layout == "qk", cfg
            k = get_kernel(cfg, arch="sm_90a")
            notes = [line for line in k.module.log.splitlines() if "wgmma" in line]
            print(dt, d, k.resources, len(notes))
            if not B90.bookkeeping_spill_only(k.resources) or notes:
                bad.append((dt, d, k.resources, notes))
    assert not bad, bad


@pytest.mark.gpu
def test_gpu_default_dispatch_reaches_this_kernel():
    """A default call at d192 runs this family (its kernels are the ones memoized) and passes the rule."""
    _require_sm90()
    B90._KERNELS.clear()
    bwd_tests._gpu_case(1, 300, 257, 4, 2, 192, True, "bfloat16")
    assert any(isinstance(cfg, AttentionBwdSm90BigConfig) for cfg, _ in B90._KERNELS), list(B90._KERNELS)
