"""Sanitizer gate: every public op and kernel family on small awkward shapes under compute-sanitizer.

    PYTHONPATH=. python3 tools/sanitize.py --out $OUT                    # every tool, every case
    PYTHONPATH=. python3 tools/sanitize.py --tools racecheck --only attention_bwd_sm90 --out $OUT
    PYTHONPATH=. python3 tools/sanitize.py --list                        # the cases (no GPU needed)

How it runs.  First every case runs once without a sanitizer ("plain", one process per case, in
parallel): that compiles the kernels into the disk cache, checks each result against the op's
reference (the float64 / CuPy references of rtkernels) and saves those references under
``--out/refs``.  Then, per tool (memcheck, racecheck, synccheck, initcheck), one compute-sanitizer
process per environment group (cases that need an import-time switch such as
RTKERNELS_MATMUL_SM90=0 run in a process of their own) runs the same cases again - same seeds,
same inputs - and compares every output with the saved reference, so a kernel that writes nothing
or garbage under the tool fails its case even where the tool reports nothing; deterministic ops
must also match the plain run bit for bit.  The sanitized processes run only rtkernels' kernels
(inputs are uploaded, outputs poisoned with memset and downloaded; no CuPy or cuBLAS kernels), and
CuPy's memory pool is off in every worker: each array is its own cudaMalloc, so memcheck sees
the true end of every buffer and initcheck sees fresh memory as uninitialized.  racecheck runs
the cases' ``quick`` subset (it is the slow tool); ``--full`` runs everything under every tool.

Errors are attributed to kernel families by the kernel name in each report (the families'
``kernels`` entry points); the table's "total" row is the tool's own summary count.  The gate
exits 1 on any sanitizer error, failed check, crash or timeout (2: usage, or no usable
compute-sanitizer), and writes ``sanitize.json`` and each tool's raw log under ``--out``, and all
of them (not the references) into one tarball, ``sanitize_logs.tgz`` beside ``--out``
(``--tarball``): on the device machine, ``--out /tmp/san --tarball $OUT/sanitize_logs.tgz``.

Findings.  Every tool's reports are grouped into distinct findings - (what, kernel, program
counter, allocation) with a count - written to ``<tool>.findings.jsonl``, attached to the records
of the cases concerned and, the most frequent, printed above the table.  The initcheck workers
log every allocation (address, size, case, variant and the lines that asked for it) and free
none, so an address is never reused and each report names the buffer it read: "bytes 512..1023
of 66560 from rtkernels/ops/attention_bwd.py:476 attention_backward".

Adding a family: one function decorated with ``@case(name, families=..., ops=...)``; an op that
is not in ``rtkernels`` yet is listed in ``requires=`` and the case is skipped with a note until it
lands.  tests/test_sanitize.py fails when a public op or a registered family has no case (or no
documented exclusion in EXCLUDED_OPS / EXCLUDED_FAMILIES).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

REPO = Path(__file__).resolve().parent.parent
TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
# Per-tool options besides the common ones.  memcheck pads every allocation so that an access past
# an array's end cannot land in the next array unseen; racecheck's "analysis" report gives one
# block per pair of racing instructions (with its hazard count) instead of one per byte.
TOOL_FLAGS = {
    "memcheck": ["--padding", "256"],
    "racecheck": ["--racecheck-report", "analysis"],
    "synccheck": [],
    "initcheck": [],
}
QUICK_TOOLS = ("racecheck",)
VARIANTS_ENV = "RTK_SANITIZE_VARIANTS"   # --variants, for the worker processes
# Tools whose workers log every allocation and free none, so that each report's address names the
# array it fell in (initcheck: which buffer was read before anything wrote it).
ALLOCATION_LOG_TOOLS = ("initcheck",)
ERROR_EXIT = 86                   # compute-sanitizer's exit code when it found errors
DEAD_EXIT = 3                     # a worker whose CUDA context died (the driver restarts the rest)


# ---- the registry ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One gate case: ``fn(ctx)`` runs its variants; ``families`` are the kernel families it
    launches, ``ops`` the public functions it calls, ``env`` variables its process needs at import
    (a separate worker process), ``requires`` rtkernels attributes that must exist to run it."""
    name: str
    fn: Callable
    families: tuple[str, ...]
    ops: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    requires: tuple[str, ...] = ()
    note: str = ""


CASES: dict[str, Case] = {}

# Public names that launch nothing of their own: they need no case.
EXCLUDED_OPS = {
    "matmul_reference": "float64 NumPy reference (host)",
    "attention_reference": "CuPy reference (CuPy/cuBLAS kernels, not rtkernels'); computes the gate's references",
    "attention_backward_reference": "CuPy reference, as attention_reference",
    "attention_merge_reference": "float64 NumPy reference (host)",
    "attention_kvcache_reference": "float64 NumPy reference (host)",
    "matmul_fp8_reference": "float64 NumPy reference (host)",
    "quantized_matmul_reference": "float64 NumPy reference (host)",
    "quantize_weight": "NumPy / CuPy array arithmetic (CuPy's own kernels), no rtkernels kernel",
    "check_kvcache_inputs": "host-side check of cache_seqlens / block_table contents (copies them to the host, "
                            "launches nothing)",
}
# Registered families with no case of their own: none today.
EXCLUDED_FAMILIES: dict[str, str] = {}


def case(name: str, *, families, ops, env=None, requires=(), note=""):
    """Register ``fn`` as gate case ``name`` (see :class:`Case`)."""
    def wrap(fn):
        if name in CASES:
            raise ValueError(f"sanitize: case {name!r} registered twice")
        CASES[name] = Case(name, fn, tuple(families), tuple(ops), tuple(sorted((env or {}).items())),
                           tuple(requires), note)
        return fn
    return wrap


def missing_requirements(c: Case) -> list[str]:
    import rtkernels as rtk
    return [r for r in c.requires if not hasattr(rtk, r)]


def kernel_families() -> dict[str, str]:
    """Kernel entry point name -> family, from every registered family's config class."""
    import rtkernels as rtk
    return {k: fam for fam, cls in rtk.families().items() for k in cls.kernels}


# ---- worker side: inputs, outputs, checks -------------------------------------------------------
class Skip(Exception):
    """A case (or variant) that cannot run here, e.g. an sm_90 kernel on another GPU."""


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)   # round to nearest even


def _from_bf16_bits(b: np.ndarray) -> np.ndarray:
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def _np_dtype(dtype: str):
    return np.uint16 if dtype == "bfloat16" else np.dtype(dtype)


def compare(got: np.ndarray, ref: np.ndarray, tol: float, metric: str) -> tuple[bool, float, str]:
    """(ok, error, message).  metric "max": max |got - ref| / max(1, max |ref|); "norm":
    ||got - ref|| / ||ref||; "exact": equal values.  NaN where the reference has none, and an
    infinity that differs from the reference's, fail whatever the metric."""
    got, ref = np.asarray(got), np.asarray(ref)
    if got.shape != ref.shape:
        return False, math.inf, f"shape {got.shape}, reference {ref.shape}"
    if metric == "exact" or ref.dtype.kind in "iub":
        same = bool(np.array_equal(got, ref, equal_nan=ref.dtype.kind == "f"))
        return same, 0.0 if same else math.inf, "" if same else f"{int(np.sum(got != ref))} elements differ"
    got, ref = got.astype(np.float64), ref.astype(np.float64)
    nan = np.isnan(got) & ~np.isnan(ref)
    if nan.any():
        return False, math.inf, f"{int(nan.sum())} NaN of {got.size} (output not written?)"
    inf_bad = np.isinf(ref) & (got != ref)
    fin = np.isfinite(ref)
    inf_bad |= fin & ~np.isfinite(got)
    if inf_bad.any():
        return False, math.inf, f"{int(inf_bad.sum())} infinities differ from the reference"
    if not fin.any():
        return True, 0.0, ""
    d, r = np.abs(got[fin] - ref[fin]), np.abs(ref[fin])
    if metric == "max":
        err = float(d.max() / max(1.0, float(r.max())))
    elif metric == "norm":
        err = float(np.linalg.norm(d) / max(float(np.linalg.norm(r)), 1e-30))
    else:
        raise ValueError(f"unknown metric {metric!r}")
    return err <= tol, err, "" if err <= tol else f"error {err:.3g} > {tol:.3g}"


def _key(label: str) -> str:
    return label.replace("/", "|")


class Ctx:
    """What a case function sees: seeded inputs, poisoned outputs, checks against references.

    ``variant(label, quick)`` starts a variant (and seeds ``rng`` from the case and label, so
    every process draws the same inputs); it returns False for a variant this run skips (not
    ``quick`` under a quick tool).  ``check`` compares an output with its reference: computed (a
    callable, evaluated only here) and saved in the plain run, loaded in the sanitized runs."""

    def __init__(self, case_name: str, phase: str, refs_dir: Path, quick: bool):
        import cupy
        self.cp = cupy
        self.case, self.phase, self.quick = case_name, phase, quick
        self.plain = phase == "plain"
        self.path = Path(refs_dir) / f"{case_name}.npz"
        self.refs = {}
        if not self.plain and self.path.exists():
            with np.load(self.path, allow_pickle=False) as z:
                self.refs = {k: z[k] for k in z.files}
        self.saved: dict[str, np.ndarray] = {}
        self.checks: list[dict] = []
        self.label = ""
        self.rng = np.random.default_rng(0)

    # variants ---------------------------------------------------------------------------------
    def variant(self, label: str, quick: bool = False) -> bool:
        if self.quick and not quick:
            return False
        wanted = [w for w in os.environ.get(VARIANTS_ENV, "").split(",") if w]
        if wanted and not any(w in label for w in wanted):
            return False
        self.label = label
        if _ALLOCS is not None:
            _ALLOCS.where = (self.case, label)
        self.rng = np.random.default_rng(zlib.crc32(f"{self.case}/{label}".encode()))
        return True

    def skip(self, why: str):
        raise Skip(why)

    def require_sm90(self):
        from rtkernels import device
        if device.current_arch() not in ("sm_90", "sm_90a"):
            raise Skip(f"needs an sm_90 device (this is {device.current_arch()})")

    # arrays -----------------------------------------------------------------------------------
    def randn(self, shape, dtype: str, scale: float = 1.0):
        """(device array, float64 host copy of exactly the values stored); bfloat16 as uint16 bits."""
        x = (self.rng.standard_normal(shape) * scale).astype(np.float32)
        if dtype == "bfloat16":
            bits = _bf16_bits(x)
            return self.cp.asarray(bits), _from_bf16_bits(bits).astype(np.float64)
        h = x.astype(dtype)
        return self.cp.asarray(h), h.astype(np.float64)

    def upload(self, host64: np.ndarray, dtype: str):
        """host64 rounded to dtype on the device, and the float64 copy of what was stored."""
        if dtype == "bfloat16":
            bits = _bf16_bits(host64.astype(np.float32))
            return self.cp.asarray(bits), _from_bf16_bits(bits).astype(np.float64)
        h = host64.astype(dtype)
        return self.cp.asarray(h), h.astype(np.float64)

    def poisoned(self, shape, dtype: str):
        """A new device array filled with 0xFF bytes (NaN in every float format used here) by a
        memset: no kernel of CuPy's runs under the sanitizer."""
        a = self.cp.empty(shape, dtype=_np_dtype(dtype))
        if a.nbytes:
            self.cp.cuda.runtime.memsetAsync(a.data.ptr, 0xFF, a.nbytes, self.cp.cuda.get_current_stream().ptr)
        return a

    def host(self, a, dtype: str) -> np.ndarray:
        """A device array's values as float64 (int64 for integer arrays); bfloat16 bits decoded."""
        h = a.get() if hasattr(a, "get") else np.asarray(a)
        if dtype == "bfloat16":
            return _from_bf16_bits(h.view(np.uint16)).astype(np.float64)
        return h if h.dtype.kind in "iub" else h.astype(np.float64)

    # checks -----------------------------------------------------------------------------------
    def check(self, name: str, got, dtype: str, ref, tol: float, metric: str = "max", exact_rerun: bool = False):
        """Compare output ``got`` (device array of ``dtype``) with ``ref`` (an array or a callable
        giving one; only the plain run evaluates it).  ``exact_rerun``: a deterministic op, whose
        sanitized result must equal the plain run's bit for bit."""
        label = f"{self.label}: {name}"
        key = _key(label)
        if any(c["label"] == label for c in self.checks):
            raise ValueError(f"sanitize: check label {label!r} used twice in case {self.case}")
        g = self.host(got, dtype)
        if self.plain:
            r = ref() if callable(ref) else ref
            r = np.asarray(r.get() if hasattr(r, "get") else r)
            self.saved["ref:" + key], self.saved["out:" + key] = r, g
        else:
            r = self.refs.get("ref:" + key)
            if r is None:
                self.checks.append(dict(label=label, ok=False, err=None, tol=tol,
                                        msg="no reference from the plain run"))
                return
        ok, err, msg = compare(g, r, tol, metric)
        if ok and exact_rerun and not self.plain:
            prev = self.refs.get("out:" + key)
            if prev is not None and not np.array_equal(g, prev, equal_nan=g.dtype.kind == "f"):
                ok, msg = False, f"differs from the unsanitized run ({int(np.sum(g != prev))} elements)"
        self.checks.append(dict(label=label, ok=bool(ok), err=None if math.isinf(err) else err, tol=tol, msg=msg))

    def save(self):
        if self.plain:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            np.savez(self.path, **self.saved)


@contextlib.contextmanager
def patched(obj, **values):
    """Set module attributes for the duration of a case (dispatch switches, thresholds)."""
    old = {k: getattr(obj, k) for k in values}
    for k, v in values.items():
        setattr(obj, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(obj, k, v)


TOL = {"float16": 2 ** -9, "bfloat16": 2 ** -6, "float32": 1e-5, "float64": 1e-12}
# Attention: relative Frobenius error (the measure of FlashAttention's tests) against a float32
# reference.  Reasoned: rounding P and the outputs to bf16 costs ~2^-8 = 4e-3 (fp16 ~5e-4); the
# bound is loose on purpose - the gate has to catch wrong or unwritten tiles and garbage (errors
# of 0.1-1, or NaN), the GPU tests hold the 2x error rule.
ATT_TOL = {"float16": 0.01, "bfloat16": 0.04}


def _bf(dtype: str) -> dict:
    return {"dtype": "bfloat16"} if dtype == "bfloat16" else {}


# ---- cases: elementwise and vector_add ---------------------------------------------------------
@case("vector_add", families=("vector_add",), ops=("vector_add",))
def _vector_add(ctx: Ctx):
    import rtkernels as rtk
    for dt in ("float16", "float32"):          # (bfloat16 only from torch tensors: no uint16 form)
        for n in (1, 1000, 4099):
            if not ctx.variant(f"{dt} n={n}", quick=n == 4099):
                continue
            (a, a64), (b, b64) = ctx.randn((n,), dt), ctx.randn((n,), dt)
            out = ctx.poisoned((n,), dt)
            rtk.vector_add(a, b, out)
            ctx.check("c", out, dt, a64 + b64, TOL[dt], exact_rerun=True)


@case("elementwise", families=("elementwise",), ops=("elementwise",))
def _elementwise(ctx: Ctx):
    import rtkernels as rtk
    f = rtk.elementwise("t = a*x + b; y = t * exp(-t*t)", outputs=("t", "y"))
    for dt in ("float16", "bfloat16", "float32", "float64"):
        for n, off in ((1, 0), (1001, 1), (3 * 4096 + 5, 3)):     # views offset by 1 and 3 elements
            if not ctx.variant(f"{dt} n={n} offset={off}", quick=off == 1):
                continue
            big, big64 = ctx.randn((n + off,), dt)
            x, x64 = big[off:], big64[off:]
            b, b64 = ctx.randn((n,), dt)
            t_out, y_out = ctx.poisoned((n,), dt), ctx.poisoned((n,), dt)
            f(0.5, x, b, out=(t_out, y_out), dtype="bfloat16" if dt == "bfloat16" else None)
            t = 0.5 * x64 + b64
            ctx.check("t", t_out, dt, t, TOL[dt], exact_rerun=True)
            ctx.check("y", y_out, dt, t * np.exp(-t * t), 4 * TOL[dt], exact_rerun=True)


# ---- cases: matmul -----------------------------------------------------------------------------
# (label, dtype, M, N, K, batch of a, batch of b, trans_a, trans_b, bias, activation, a_off, c_pad,
# quick).  a_off > 0: a is a view starting a_off elements into rows of a wider parent (a base and
# row stride TMA cannot address); c_pad > 0: out is a view into rows c_pad elements wider (odd
# row stride).  What each reaches on sm_90 by default: the Hopper kernel where TMA can address A
# and B (with a TMA-store epilogue, or direct stores for an odd C), the mma.sync kernel for small
# unaligned problems (below the staging threshold), the SIMT kernel for float32.
MATMUL_VARIANTS = (
    ("bf16 65x40x72 bias gelu", "bfloat16", 65, 40, 72, 0, 0, False, False, True, "gelu", 0, 0, True),
    ("f16 136x200x64 trans_a trans_b relu odd C", "float16", 136, 200, 64, 0, 0, True, True, True, "relu", 0, 3,
     False),
    ("bf16 batch 3x40x24x64 b broadcast", "bfloat16", 40, 24, 64, 3, 0, False, False, False, None, 0, 0, True),
    ("f16 batch 2x17x136x40 trans_b silu", "float16", 17, 136, 40, 2, 2, False, True, True, "silu", 0, 0, False),
    ("f16 1x8x8", "float16", 1, 8, 8, 0, 0, False, False, False, None, 0, 0, False),
    ("bf16 1x1x1 bias", "bfloat16", 1, 1, 1, 0, 0, False, False, True, None, 0, 0, False),
    ("bf16 33x50x37 a offset 1", "bfloat16", 33, 50, 37, 0, 0, False, False, True, "gelu", 1, 0, False),
    ("f32 37x45x29 silu odd C", "float32", 37, 45, 29, 0, 0, False, False, True, "silu", 0, 1, False),
    # rule 4's width off the 64-column grid (128 x 152: TMA-stored boxes + direct stores of the rest)
    ("bf16 512x5000x64 trans_b bias silu: 128x152 tile", "bfloat16", 512, 5000, 64, 0, 0, False, True, True, "silu",
     0, 0, True),
)
# Staged operands (pad_rows copies, then the Hopper kernel), the size thresholds lowered for the
# case: an offset view and K = 37 (rows TMA cannot address), and K = 72 / N = 40 (144- and 80-byte
# rows: addressable, not 32-byte aligned: the realignment copy).
MATMUL_STAGED = (
    ("bf16 33x50x37 a offset 1 staged", "bfloat16", 33, 50, 37, 0, 0, False, False, True, "gelu", 1, 0, True),
    ("f16 batch 2x40x24x37 trans_b staged", "float16", 40, 24, 37, 2, 2, False, True, False, None, 0, 0, False),
    ("bf16 65x40x72 realigned", "bfloat16", 65, 40, 72, 0, 0, False, False, True, "gelu", 0, 0, False),
)


def _matmul_variant(ctx: Ctx, v):
    import rtkernels as rtk
    from rtkernels.ops import matmul as mm
    label, dt, M, N, K, ba, bb, ta, tb, has_bias, act, off, c_pad, quick = v
    if not ctx.variant(label, quick=quick):
        return
    a_shape = ((ba,) if ba else ()) + ((K, M) if ta else (M, K))
    if off:
        parent, parent64 = ctx.randn((*a_shape[:-1], a_shape[-1] + off + 3), dt)
        a, a64 = parent[..., off:off + a_shape[-1]], parent64[..., off:off + a_shape[-1]]
    else:
        a, a64 = ctx.randn(a_shape, dt)
    b, b64 = ctx.randn(((bb,) if bb else ()) + ((N, K) if tb else (K, N)), dt)
    bias, bias64 = ctx.randn((N,), dt) if has_bias else (None, None)
    lead = (max(ba, bb),) if max(ba, bb) else ()
    out_parent = ctx.poisoned(lead + (M, N + c_pad), dt)
    out = out_parent[..., :N] if c_pad else out_parent
    rtk.matmul(a, b, bias=bias, activation=act, out=out, trans_a=ta, trans_b=tb, **_bf(dt))
    ref = lambda: np.pad(mm.matmul_reference(a64, b64, bias=bias64, activation=act, trans_a=ta, trans_b=tb),  # noqa
                         [(0, 0)] * (len(lead) + 1) + [(0, c_pad)], constant_values=np.nan)
    # (the whole parent is compared: the padding columns must keep their NaN poison)
    ctx.check("c", out_parent, dt, ref, 2 * TOL[dt], exact_rerun=True)


@case("matmul_sm90", families=("matmul_sm90", "matmul", "pad_rows", "quant_gemv"), ops=("matmul",),
      note="sm_90: the Hopper kernel, its mma.sync / SIMT fallbacks, staged operands; one-row C: the GEMV")
def _matmul_sm90(ctx: Ctx):
    from rtkernels.ops import matmul as mm
    for v in MATMUL_VARIANTS:
        _matmul_variant(ctx, v)
    # (plans recorded above for the same signatures would replay the unstaged launches)
    mm._LAUNCHES.clear()
    try:
        with patched(mm, STAGE_MIN_WORK=0, REALIGN_MIN_MN=0, REALIGN_MIN_WORK=0):
            for v in MATMUL_STAGED:
                _matmul_variant(ctx, v)
    finally:
        mm._LAUNCHES.clear()


@case("matmul_sm90_sync", families=("matmul_sm90",), ops=("matmul",),
      env={"RTKERNELS_MATMUL_SM90_MMA": "sync"},
      note="the Hopper kernel's ldmatrix + mma.sync consumers (switch read at import)")
def _matmul_sm90_sync(ctx: Ctx):
    ctx.require_sm90()
    for v in MATMUL_VARIANTS[:4]:
        _matmul_variant(ctx, v)


# Cluster-K forced on the heuristic's tiles: small walks, a ragged K split (3 k-blocks: 1 + 2), and more
# tiles than the grid's clusters (1100 x 1100: 81 tiles of 128 x 128 over at most 66 clusters), so the
# exchange's buffer is handed back (xempty) and reused.
MATMUL_CLUSTER_K = (
    ("bf16 1100x1100x130 bias gelu: tiles > clusters", "bfloat16", 1100, 1100, 130, 0, 0, False, False, True, "gelu",
     0, 0, True),
    ("f16 batch 2x300x200x1000 trans_b odd C", "float16", 300, 200, 1000, 2, 2, False, True, False, None, 0, 3, True),
)


@case("matmul_cluster_k", families=("matmul_sm90",), ops=("matmul",),
      env={"RTKERNELS_MATMUL_CLUSTER_K": "2"},
      note="cluster-K (2-CTA clusters summing halves of K through distributed shared memory) on every shape")
def _matmul_cluster_k(ctx: Ctx):
    ctx.require_sm90()
    for v in MATMUL_VARIANTS[:4] + MATMUL_CLUSTER_K:
        _matmul_variant(ctx, v)


@case("matmul_mma_sync", families=("matmul",), ops=("matmul",),
      env={"RTKERNELS_MATMUL_SM90": "0", "RTKERNELS_MATMUL_GEMV": "0"},
      note="the mma.sync / SIMT kernels for every shape (the Hopper kernel and the GEMV route off at import)")
def _matmul_mma_sync(ctx: Ctx):
    for v in MATMUL_VARIANTS:
        _matmul_variant(ctx, v)


# fp8 (CuPy uint8 bits): (label, a type, b type, M, N, K, b stored (K, N) row-major (the transpose8
# pass) or (N, K) with trans_b, scale_a kind, scale_b kind, out dtype, bias, activation, quick)
MATMUL_FP8 = (
    ("e4m3 129x200x272 b (K, N): transpose8, tensor scales, bf16", "float8_e4m3fn", "float8_e4m3fn", 129, 200, 272,
     True, "tensor", "tensor", "bfloat16", False, None, True),
    ("e5m2 x e4m3 7x70x48 trans_b, row / col scales, f32, bias, gelu", "float8_e5m2", "float8_e4m3fn", 7, 70, 48,
     False, "row", "col", "float32", True, "gelu", False),
)


def _fp8_bits(ctx: Ctx, shape, dtype: str):
    """Random fp8 codes of moderate magnitude (no NaN / inf codes): |x| < 16."""
    top = 0x58 if dtype == "float8_e4m3fn" else 0x4C
    return (ctx.rng.integers(0, top, shape) | (ctx.rng.integers(0, 2, shape) << 7)).astype(np.uint8)


@case("matmul_fp8", families=("matmul_fp8_sm90", "transpose8"), ops=("matmul",),
      note="sm_90: fp8 operands (CuPy uint8 bits), the K-major transpose pass, scales, epilogues")
def _matmul_fp8(ctx: Ctx):
    import rtkernels as rtk
    from rtkernels.ops import matmul_fp8 as f8
    ctx.require_sm90()
    for label, ta, tb, M, N, K, b_kn, ska, skb, od, has_bias, act, quick in MATMUL_FP8:
        if not ctx.variant(label, quick=quick):
            continue
        a8 = _fp8_bits(ctx, (M, K), ta)
        b8 = _fp8_bits(ctx, (K, N), tb)
        sa = ctx.rng.uniform(0.5, 2.0, 1 if ska == "tensor" else M).astype(np.float32)
        sb = ctx.rng.uniform(0.5, 2.0, 1 if skb == "tensor" else N).astype(np.float32)
        bias, bias64 = ctx.randn((N,), od) if has_bias else (None, None)
        out = ctx.poisoned((M, N), od)
        b_dev = ctx.cp.asarray(b8) if b_kn else ctx.cp.asarray(np.ascontiguousarray(b8.T))
        rtk.matmul(ctx.cp.asarray(a8), b_dev, trans_b=not b_kn, dtype=(ta, tb), scale_a=ctx.cp.asarray(sa),
                   scale_b=ctx.cp.asarray(sb), bias=bias, activation=act, out=out, out_dtype=od)
        ref = lambda: f8.matmul_fp8_reference(a8, b8, a_dtype=ta, b_dtype=tb, scale_a=sa, scale_b=sb,  # noqa
                                              bias=bias64, activation=act)
        # f32 outputs: the tensor cores' reduced-precision sums inside each 128-deep K step
        ctx.check("c", out, od, ref, 2 ** -10 if od == "float32" else 2 * TOL[od], exact_rerun=True)


@case("pad_rows", families=("pad_rows",), ops=(),
      note="the staging copy itself (rtkernels.ops.matmul._pad_rows): every source alignment")
def _pad_rows(ctx: Ctx):
    from rtkernels.ops import matmul as mm
    for rows, cols, ld, offset, nb, quick in ((5, 1, 3, 1, 1, False), (7, 7, 7, 3, 1, True), (9, 8, 11, 5, 2, False),
                                              (3, 9, 9, 0, 1, False), (6, 300, 301, 7, 3, True),
                                              (4, 1027, 1031, 2, 2, False)):
        if not ctx.variant(f"{nb}x{rows}x{cols} ld={ld} offset={offset}", quick=quick):
            continue
        bs = rows * ld + 5 if nb > 1 else 0
        n = offset + (nb - 1) * bs + (rows - 1) * ld + cols      # the source ends where its array does
        flat_h = ctx.rng.integers(0, 2 ** 16, n, dtype=np.uint16)
        flat = ctx.cp.asarray(flat_h)
        src = ctx.cp.lib.stride_tricks.as_strided(flat[offset:], (nb, rows, cols), (2 * bs, 2 * ld, 2))
        st = mm._Stage(rows, cols, nb, ld, bs, src.dtype)
        buf = mm._pad_rows(src, st, None)
        want = np.lib.stride_tricks.as_strided(flat_h[offset:], (nb, rows, cols), (2 * bs, 2 * ld, 2)).copy()
        # the row parts only, gathered on the device: the pad columns past `cols` are never
        # written (TMA zero-fills past the true extent), and copying them to the host reads
        # uninitialized bytes (initcheck: 179 host-access reports, H100, 2026-11-25)
        rows_only = ctx.host(buf[:, :, :cols].copy(), "uint16")
        ctx.check("rows", rows_only, "uint16", want, 0, "exact")


# ---- cases: weight-only quantized matmul -------------------------------------------------------
# (label, dtype, M, N, K, weight kind, group, zeros, bias, activation, quick).  K = 2100 with N = 7:
# split-K (float32 partials summed by the last split in the same launch) and 4-byte loads; K = 129: byte loads and a tail
# inside a 16-byte chunk; M = 20: the dequantize kernel + rtk.matmul.
QUANT_VARIANTS = (
    ("bf16 int8 3x129x129 per-row bias gelu", "bfloat16", 3, 129, 129, "int8", None, False, True, "gelu", True),
    ("f16 uint8 16x7x2100 g128 zeros split-K", "float16", 16, 7, 2100, "uint8", 128, True, False, None, False),
    ("bf16 fp8 1x40x200 g64 silu", "bfloat16", 1, 40, 200, "float8_e4m3", 64, False, True, "silu", False),
    ("f16 int8 20x33x72 g64 zeros dequantized + matmul", "float16", 20, 33, 72, "int8", 64, True, True, "relu",
     True),
    # x_half: a CTA's own float16 copy of x (M = 1), the conversion kernel's (M = 12, and ragged K), the
    # grid's own (zero points, M = 3 and 16: CTAs release the copy, every CTA acquires it)
    ("bf16 int8 1x6144x1000 per-row x_shared", "bfloat16", 1, 6144, 1000, "int8", None, False, True, None, True),
    ("bf16 int8 12x6144x520 per-row x_half copy", "bfloat16", 12, 6144, 520, "int8", None, False, False, None, True),
    ("bf16 uint8 3x10240x200 g64 zeros x_grid", "bfloat16", 3, 10240, 200, "uint8", 64, True, False, "silu",
     False),
    ("bf16 uint8 16x6144x1000 g128 zeros x_grid", "bfloat16", 16, 6144, 1000, "uint8", 128, True, True, None, True),
    # group scales at M = 8 from N = 8192 and at K >= 16384: 32-row tiles (the last of 8 rows), through
    # the grid's copy and with float16 x
    ("bf16 uint8 8x8200x1024 g128 zeros 32-row tiles", "bfloat16", 8, 8200, 1024, "uint8", 128, True, True, "silu",
     True),
    ("f16 int8 8x8200x1024 g64 32-row tiles", "float16", 8, 8200, 1024, "int8", 64, False, False, None, False),
    ("bf16 int8 3x8200x16384 g128 32-row tiles x_grid", "bfloat16", 3, 8200, 16384, "int8", 128, False, False, None,
     False),
)


@case("quant_gemv", families=("quant_gemv", "matmul_sm90", "matmul"), ops=("quantized_matmul",),
      note="the GEMV (per-row / group scales, zeros, split-K, narrow loads, bfloat16 x through float16 copies) and "
           "the M > 16 dequantize path")
def _quant_gemv(ctx: Ctx):
    import rtkernels as rtk
    from rtkernels.ops import quant_matmul as qm
    for label, dt, M, N, K, kind, group, zeros, has_bias, act, quick in QUANT_VARIANTS:
        if not ctx.variant(label, quick=quick):
            continue
        w = ctx.rng.standard_normal((N, K)).astype(np.float32)
        res = qm.quantize_weight(w, dtype=kind, group_size=group)   # on the host (NumPy)
        q, s = res[0], res[1]
        z = res[2] if len(res) == 3 else None
        if zeros and kind == "int8":
            z = ctx.rng.integers(-20, 20, s.shape).astype(np.int8)
        x, x64 = ctx.randn((M, K), dt)
        bias, b64 = ctx.randn((N,), dt) if has_bias else (None, None)
        out = ctx.poisoned((M, N), dt)
        rtk.quantized_matmul(x, ctx.cp.asarray(q), ctx.cp.asarray(s), group_size=group,
                             zeros=None if z is None else ctx.cp.asarray(z), bias=bias, activation=act, out=out,
                             weight_dtype="float8_e4m3" if kind == "float8_e4m3" else None, **_bf(dt))
        ref = lambda: qm.quantized_matmul_reference(x64, q, s, group_size=group, zeros=z, bias=b64,  # noqa: E731
                                                    activation=act, weight_dtype=kind)
        ctx.check("y", out, dt, ref, 2 * TOL[dt], exact_rerun=True)


# (label, dtype, N, K, kind, group, zeros, out shifted 2 bytes off a 16-byte boundary, quick)
DEQUANT_VARIANTS = (
    ("bf16 int8 129x200", "bfloat16", 129, 200, "int8", None, False, False, True),
    ("f16 uint8 77x136 g64 zeros, shifted out", "float16", 77, 136, "uint8", 64, True, True, True),
    ("bf16 e4m3 33x1000 g128", "bfloat16", 33, 1000, "float8_e4m3", 128, False, False, False),
)


@case("quant_dequantize", families=("quant_gemv",), ops=("dequantize_weight",),
      note="rtk.dequantize_weight: the GEMV family's dequantize kernel into a fresh or a misaligned out")
def _quant_dequantize(ctx: Ctx):
    import rtkernels as rtk
    from rtkernels.ops import quant_matmul as qm
    for label, dt, N, K, kind, group, zeros, shifted, quick in DEQUANT_VARIANTS:
        if not ctx.variant(label, quick=quick):
            continue
        res = qm.quantize_weight(ctx.rng.standard_normal((N, K)).astype(np.float32), dtype=kind, group_size=group)
        q, s = res[0], res[1]
        z = res[2] if len(res) == 3 and zeros else None
        if shifted:   # C-contiguous, starting 2 bytes past a 16-byte boundary
            out = ctx.poisoned((N * K + 8,), dt)[1:1 + N * K].reshape(N, K)
        else:
            out = ctx.poisoned((N, K), dt)
        rtk.dequantize_weight(ctx.cp.asarray(q), ctx.cp.asarray(s), group_size=group,
                              zeros=None if z is None else ctx.cp.asarray(z), dtype=dt, out=out,
                              weight_dtype="float8_e4m3" if kind == "float8_e4m3" else None)
        ref = lambda: qm.dequantize_reference(q, s, group_size=group, zeros=z, weight_dtype=kind)  # noqa: E731
        ctx.check("w", out, dt, ref, TOL[dt], exact_rerun=True)


# ---- cases: attention forward ------------------------------------------------------------------
# (batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, causal, dtype, layout, quick); layout
# "packed": q, k, v slices of one (b, s, 3, h, d) array.  Sq > Sk causal leaves rows that see no
# key (o = 0, lse = -inf).
ATTN_FWD_VARIANTS = (
    (2, 130, 200, 4, 2, 64, True, "bfloat16", "", True),
    (1, 70, 33, 2, 1, 128, True, "float16", "", False),
    (1, 33, 70, 4, 4, 40, False, "bfloat16", "", False),
    (1, 130, 130, 2, 1, 96, True, "float16", "", False),
    (1, 64, 257, 2, 2, 192, False, "bfloat16", "", False),
    (2, 100, 100, 2, 1, 256, True, "bfloat16", "", True),
    (1, 77, 77, 3, 3, 80, False, "bfloat16", "packed", False),
    (1, 1, 300, 4, 1, 128, False, "bfloat16", "", False),
    (1, 600, 700, 2, 1, 64, True, "float16", "", True),   # two 64-row CTAs per SM (SHORT_SCHEDULE, d64 causal)
)


def _attn_inputs(ctx: Ctx, batch, sq, sk, h, hkv, d, dt, layout=""):
    if layout == "packed":
        qkv, _ = ctx.randn((batch, sq, 3, h, d), dt)
        return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    return (ctx.randn((batch, sq, h, d), dt)[0], ctx.randn((batch, sk, hkv, d), dt)[0],
            ctx.randn((batch, sk, hkv, d), dt)[0])


def _attn_label(batch, sq, sk, h, hkv, d, causal, dt, layout=""):
    return f"{dt} b{batch} sq{sq} sk{sk} h{h}/{hkv} d{d}{' causal' if causal else ''}{' ' + layout if layout else ''}"


def _attention_forward(ctx: Ctx, variants):
    import rtkernels as rtk
    from rtkernels.ops.attention import attention_reference
    for batch, sq, sk, h, hkv, d, causal, dt, layout, quick in variants:
        if not ctx.variant(_attn_label(batch, sq, sk, h, hkv, d, causal, dt, layout), quick=quick):
            continue
        q, k, v = _attn_inputs(ctx, batch, sq, sk, h, hkv, d, dt, layout)
        out = ctx.poisoned((batch, sq, h, d), dt)
        o, lse = rtk.attention(q, k, v, causal=causal, out=out, **_bf(dt))
        ref = {}

        def reference(i):
            if not ref:
                ref["v"] = [x.get() for x in attention_reference(q, k, v, causal, **_bf(dt))]
            return ref["v"][i]
        ctx.check("o", o, dt, lambda: reference(0), ATT_TOL[dt], "norm", exact_rerun=True)
        ctx.check("lse", lse, "float32", lambda: reference(1), 1e-3, exact_rerun=True)


@case("attention_fwd_sm90", families=("attention_sm90",), ops=("attention",))
def _attention_fwd_sm90(ctx: Ctx):
    ctx.require_sm90()
    _attention_forward(ctx, ATTN_FWD_VARIANTS)


@case("attention_fwd_mma", families=("attention",), ops=("attention",),
      note="the mma.sync forward (on sm_90 with the Hopper kernel switched off)")
def _attention_fwd_mma(ctx: Ctx):
    from rtkernels.ops import attention as A, attention_sm90 as A90
    A._FORWARD_PLANS.clear()                   # plans recorded with the Hopper kernel must not replay
    try:
        with patched(A90, ENABLED=False):
            _attention_forward(ctx, ATTN_FWD_VARIANTS)
    finally:
        A._FORWARD_PLANS.clear()


# ---- cases: attention backward -----------------------------------------------------------------
# (batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, causal, dtype, deterministic, quick)
ATTN_BWD_SM90_VARIANTS = (
    (1, 130, 200, 2, 1, 128, True, "bfloat16", False, True),     # issue 22's racecheck repro (lpt_grid now)
    (2, 150, 260, 4, 2, 120, True, "float16", False, True),      # lpt_grid over two pairs, GQA
    (1, 130, 200, 2, 1, 128, True, "bfloat16", True, True),
    (2, 113, 203, 4, 2, 64, False, "float16", False, False),
    (1, 70, 33, 2, 2, 40, True, "bfloat16", True, True),         # Sq > Sk: rows with no key
    (1, 200, 64, 4, 1, 96, False, "bfloat16", True, False),
    (1, 65, 65, 2, 2, 72, True, "float16", False, False),
)
# head dims 136..256 on sm_90: attention_bwd_sm90_big (the head dim split between its consumer
# warpgroups; P^T / dS^T through shared memory; dQ by register reductions, ordered when deterministic)
ATTN_BWD_SM90_BIG_VARIANTS = (
    (1, 130, 200, 2, 1, 256, True, "bfloat16", False, True),
    (1, 130, 200, 2, 1, 192, True, "bfloat16", True, True),
    (1, 70, 33, 2, 2, 136, True, "float16", True, True),         # Sq > Sk: rows with no key
    (2, 113, 203, 4, 2, 200, False, "float16", False, True),    # ring dQ + stagger (non-causal d200-256)
    (1, 77, 77, 2, 2, 248, False, "bfloat16", True, False),
    (1, 150, 190, 2, 1, 176, False, "bfloat16", False, True),    # layout qk, 96 keys, bulk dQ, stagger (non-causal <= 192)
)
# The mma.sync backward through its heuristic configs at every head dim (dQ modes red / staged /
# pass; above 128 the op dispatches to attention_bwd_sm90_big on sm_90).
ATTN_BWD_MMA_VARIANTS = (
    (1, 130, 200, 2, 1, 256, True, "bfloat16", False, True),
    (1, 70, 90, 4, 2, 160, False, "float16", True, False),
    (1, 77, 77, 2, 2, 192, True, "bfloat16", True, False),
    (1, 130, 200, 2, 1, 128, True, "bfloat16", False, False),
    (1, 113, 203, 4, 2, 64, False, "float16", False, False),
    (1, 113, 203, 4, 2, 64, True, "bfloat16", True, False),
    (1, 70, 33, 2, 2, 40, True, "bfloat16", True, True),
)


def _attention_backward(ctx: Ctx, variants, config_for):
    import rtkernels as rtk
    from rtkernels.ops.attention_bwd import attention_backward_reference
    for batch, sq, sk, h, hkv, d, causal, dt, det, quick in variants:
        label = _attn_label(batch, sq, sk, h, hkv, d, causal, dt) + (" deterministic" if det else "")
        if not ctx.variant(label, quick=quick):
            continue
        q, k, v = _attn_inputs(ctx, batch, sq, sk, h, hkv, d, dt)
        do = ctx.randn((batch, sq, h, d), dt)[0]
        # o into a memset buffer.  The Hopper forward writes o with TMA stores (cp.async.bulk.tensor),
        # which initcheck apparently does not count as initializing: on an H100 (2026-11-25) each of
        # the six Hopper backward variants reported 256 uninitialized reads (and the mma.sync ones
        # more), and the backward's pre-pass reading o is the only place where a kernel reads a
        # TMA-stored buffer in this gate.  o's every element is checked in the forward cases, and an
        # unwritten o (poison) would turn delta and every gradient here into NaN.
        # RTKERNELS_SANITIZE_RAW_O=1: o as the forward allocates it (to see what initcheck makes of it).
        out = None if os.environ.get("RTKERNELS_SANITIZE_RAW_O") == "1" else ctx.poisoned((batch, sq, h, d), dt)
        o, lse = rtk.attention(q, k, v, causal=causal, out=out, **_bf(dt))
        dq, dk, dv = ctx.poisoned(q.shape, dt), ctx.poisoned(k.shape, dt), ctx.poisoned(v.shape, dt)
        rtk.attention_backward(do, q, k, v, o, lse, causal=causal, deterministic=det, dq=dq, dk=dk, dv=dv,
                               config=config_for(dt, d, causal, det), **_bf(dt))
        ref = {}

        def reference(i):
            if not ref:
                ref["v"] = [x.get() for x in attention_backward_reference(do, q, k, v, causal, **_bf(dt))]
            return ref["v"][i]
        for i, (name, g) in enumerate((("dq", dq), ("dk", dk), ("dv", dv))):
            # dQ is summed with float32 atomics unless deterministic: bits vary run to run
            ctx.check(name, g, dt, lambda i=i: reference(i), ATT_TOL[dt], "norm", exact_rerun=det or name != "dq")


@case("attention_bwd_sm90", families=("attention_bwd_sm90", "attention_sm90"), ops=("attention_backward",))
def _attention_bwd_sm90(ctx: Ctx):
    from rtkernels.ops import attention_bwd_sm90 as B90
    ctx.require_sm90()
    # the config given explicitly: a silent fall-back to the mma.sync kernel cannot pass for it
    _attention_backward(ctx, ATTN_BWD_SM90_VARIANTS, lambda dt, d, c, det: B90.choose_config(dt, d, c, det))


@case("attention_bwd_sm90_big", families=("attention_bwd_sm90_big", "attention_sm90"), ops=("attention_backward",))
def _attention_bwd_sm90_big(ctx: Ctx):
    from rtkernels.ops import attention_bwd_sm90_big as BIG
    ctx.require_sm90()
    _attention_backward(ctx, ATTN_BWD_SM90_BIG_VARIANTS, lambda dt, d, c, det: BIG.choose_config(dt, d, c, det))


@case("attention_bwd_mma", families=("attention_backward", "attention_sm90"), ops=("attention_backward",),
      note="the mma.sync backward through its own heuristic configs at every head dim")
def _attention_bwd_mma(ctx: Ctx):
    from rtkernels import device
    from rtkernels.ops import attention_bwd as B
    arch = device.current_arch()
    _attention_backward(ctx, ATTN_BWD_MMA_VARIANTS, lambda dt, d, c, det: B.choose_config(dt, d, c, det, arch))


# ---- cases: attention masks (varlen, sliding windows, softcap) --------------------------------
# (seqlens_q, seqlens_k, nheads, nheads_kv, head_dim, causal, window, softcap, dtype,
# deterministic, quick); seqlens None: one dense (batch 1) problem of seqlens_q[0] x seqlens_k[0].
# Varlen batches hold an empty sequence and ones shorter than a tile (the schedule pre-kernel's
# edge cases); Sq > Sk causal leaves rows that see no key.
ATTN_MASK_VARIANTS = (
    ((37, 0, 130, 64), (50, 10, 130, 33), 4, 2, 64, True, None, None, "bfloat16", True, True),
    ((200,), (200,), 2, 1, 128, True, (48, 0), None, "bfloat16", False, True),      # dense sliding window
    ((70,), (90,), 2, 2, 64, False, None, 30.0, "float16", True, False),           # dense softcap
    ((5, 77, 0, 129), (9, 64, 3, 100), 2, 1, 96, False, (32, 8), 20.0, "float16", False, False),
)


def _attention_masks(ctx: Ctx, bwd_config_for=None):
    import rtkernels as rtk
    from rtkernels.ops.attention import attention_reference
    from rtkernels.ops.attention_bwd import attention_backward_reference
    for lq, lk, h, hkv, d, causal, window, softcap, dt, det, quick in ATTN_MASK_VARIANTS:
        varlen = len(lq) > 1
        label = (f"{dt} {'varlen ' if varlen else ''}sq{'/'.join(map(str, lq))} sk{'/'.join(map(str, lk))} "
                 f"h{h}/{hkv} d{d}{' causal' if causal else ''}{f' window{window}' if window else ''}"
                 f"{f' softcap{softcap:g}' if softcap else ''}{' deterministic' if det else ''}")
        if not ctx.variant(label, quick=quick):
            continue
        tq, tk = sum(lq), sum(lk)
        lead_q, lead_k = ((tq,), (tk,)) if varlen else ((1, tq), (1, tk))
        q, k, v = (ctx.randn((*lead_q, h, d), dt)[0], ctx.randn((*lead_k, hkv, d), dt)[0],
                   ctx.randn((*lead_k, hkv, d), dt)[0])
        do = ctx.randn((*lead_q, h, d), dt)[0]
        opts = dict(window=window, softcap=softcap, **_bf(dt))
        if varlen:   # both hints given: nothing read back (the capture-safe path)
            opts.update(cu_seqlens_q=ctx.cp.asarray(np.cumsum((0, *lq)), dtype=ctx.cp.int32),
                        cu_seqlens_k=ctx.cp.asarray(np.cumsum((0, *lk)), dtype=ctx.cp.int32),
                        max_seqlen_q=max(lq), max_seqlen_k=max(lk))
        ref_opts = {n: opts[n] for n in ("window", "softcap", "cu_seqlens_q", "cu_seqlens_k", "dtype") if n in opts}
        out = ctx.poisoned(q.shape, dt)   # a memset o for the backward's pre-pass (see _attention_backward)
        o, lse = rtk.attention(q, k, v, causal=causal, out=out, **opts)
        dq, dk, dv = ctx.poisoned(q.shape, dt), ctx.poisoned(k.shape, dt), ctx.poisoned(v.shape, dt)
        config = bwd_config_for(dt, d, causal, det, window, softcap, varlen) if bwd_config_for else None
        rtk.attention_backward(do, q, k, v, o, lse, causal=causal, deterministic=det, dq=dq, dk=dk, dv=dv,
                               config=config, **opts)
        ref = {}

        def reference(i):
            if not ref:
                ref["v"] = [x.get() for x in (*attention_reference(q, k, v, causal, **ref_opts),
                                              *attention_backward_reference(do, q, k, v, causal, **ref_opts))]
            return ref["v"][i]
        ctx.check("o", o, dt, lambda: reference(0), ATT_TOL[dt], "norm", exact_rerun=True)
        ctx.check("lse", lse, "float32", lambda: reference(1), 1e-3, exact_rerun=True)
        for i, (name, g) in enumerate((("dq", dq), ("dk", dk), ("dv", dv))):
            ctx.check(name, g, dt, lambda i=i: reference(2 + i), ATT_TOL[dt], "norm",
                      exact_rerun=det or name != "dq")


@case("attention_masks", families=("attention_schedule", "attention_sm90", "attention_bwd_sm90"),
      ops=("attention", "attention_backward"),
      note="varlen (schedule pre-kernel), sliding windows, softcap: forward and backward as dispatched")
def _attention_masks_dispatched(ctx: Ctx):
    _attention_masks(ctx)


@case("attention_masks_mma", families=("attention_schedule", "attention", "attention_backward"),
      ops=("attention", "attention_backward"),
      note="varlen, windows, softcap on the mma.sync kernels (on sm_90 with the Hopper kernels switched off)")
def _attention_masks_mma(ctx: Ctx):
    from rtkernels import device
    from rtkernels.ops import attention as A, attention_bwd as B, attention_sm90 as A90
    from rtkernels.ops.attention_mask import mask_spec
    arch = device.current_arch()

    def config_for(dt, d, causal, det, window, softcap, varlen):   # the mma.sync backward, named
        flags = mask_spec(causal, window, softcap, varlen).flags()   # as the op normalizes them
        return B.choose_config(dt, d, flags.pop("causal"), det, arch, **flags)
    A._FORWARD_PLANS.clear()                   # plans recorded with the Hopper kernel must not replay
    try:
        with patched(A90, ENABLED=False):
            _attention_masks(ctx, config_for)
    finally:
        A._FORWARD_PLANS.clear()


# ---- cases: row ops ----------------------------------------------------------------------------
ROW_WIDTHS = (1, 7, 33, 1000, 4096, 8191, 32768)
ROW_QUICK = (33, 4096)


def _rows(ctx: Ctx, dt: str, rows: int, n: int, strided: bool, specials: bool = False):
    """(x, float64 copy): rows of width n, optionally a row slice of a wider array (row stride
    n + 8) and (softmax) with an all -inf row and an all-equal row."""
    big, big64 = ctx.randn((rows, n + 8 if strided else n), dt, scale=3.0)
    if specials and rows >= 3 and n > 1:
        big64[0] = -np.inf
        big64[1] = 0.5
        big, big64 = ctx.upload(big64, dt)
    return (big[:, :n], big64[:, :n]) if strided else (big, big64)


def _softmax_variant(ctx: Ctx, x, x64, dt, config=None):
    import rtkernels as rtk
    from rtkernels.ops import rowwise as rw
    for log in (False, True):
        y = ctx.poisoned(x64.shape, dt)
        rtk.softmax(x, out=y, log_softmax=log, config=config, **_bf(dt))
        ctx.check("log_softmax" if log else "softmax", y, dt, lambda log=log: rw.softmax_reference(x64, log),
                  TOL[dt], exact_rerun=True)


def _norm_variants(ctx: Ctx, x, x64, dt, wdt, ops=("rmsnorm", "layernorm"), config=None):
    import rtkernels as rtk
    from rtkernels.ops import rowwise as rw
    n = x64.shape[-1]
    w, w64 = ctx.randn((n,), wdt)
    b, b64 = ctx.randn((n,), wdt)
    if "rmsnorm" in ops:
        y = ctx.poisoned(x64.shape, dt)
        rtk.rmsnorm(x, w, out=y, config=config, **_bf(dt))
        ctx.check("rmsnorm", y, dt, lambda: rw.rmsnorm_reference(x64, w64), 2 * TOL[dt], exact_rerun=True)
    if "layernorm" in ops:
        y = ctx.poisoned(x64.shape, dt)
        rtk.layernorm(x, w, b, out=y, config=config, **_bf(dt))
        ctx.check("layernorm", y, dt, lambda: rw.layernorm_reference(x64, w64, b64), 4 * TOL[dt], exact_rerun=True)


@case("softmax", families=("softmax",), ops=("softmax",))
def _softmax(ctx: Ctx):
    for dt in ("float16", "bfloat16", "float32"):
        for n in ROW_WIDTHS:
            for strided in (False, True):
                if not ctx.variant(f"{dt} 5x{n}{' strided' if strided else ''}", quick=n in ROW_QUICK and strided):
                    continue
                x, x64 = _rows(ctx, dt, 5, n, strided, specials=True)
                _softmax_variant(ctx, x, x64, dt)


@case("rmsnorm", families=("norm",), ops=("rmsnorm",))
def _rmsnorm(ctx: Ctx):
    for dt in ("float16", "bfloat16", "float32"):
        for n in ROW_WIDTHS:
            wdt = "float32" if n == 1000 else dt              # float32 weights with 16-bit rows
            if not ctx.variant(f"{dt} 5x{n} strided w={wdt}", quick=n in ROW_QUICK):
                continue
            x, x64 = _rows(ctx, dt, 5, n, True)
            _norm_variants(ctx, x, x64, dt, wdt, ops=("rmsnorm",))


@case("layernorm", families=("norm",), ops=("layernorm",))
def _layernorm(ctx: Ctx):
    for dt in ("float16", "bfloat16", "float32"):
        for n in ROW_WIDTHS:
            wdt = "float32" if n == 4096 else dt
            if not ctx.variant(f"{dt} 5x{n} w={wdt}", quick=n in ROW_QUICK):
                continue
            x, x64 = _rows(ctx, dt, 5, n, n % 2 == 1)
            _norm_variants(ctx, x, x64, dt, wdt, ops=("layernorm",))


@case("reduce", families=("reduce",), ops=("reduce",))
def _reduce(ctx: Ctx):
    import rtkernels as rtk
    from rtkernels.ops import rowwise as rw
    # few wide rows (70001, 262144): spread over a cluster of blocks on sm_90
    for dt in ("float16", "bfloat16", "float32"):
        for rows, n in ((5, 1), (5, 33), (7, 1000), (3, 8191), (3, 70001), (1, 262144)):
            if not ctx.variant(f"{dt} {rows}x{n}", quick=n in (33, 70001)):
                continue
            x, x64 = _rows(ctx, dt, rows, n, False)
            for op in ("sum", "max", "min", "argmax"):
                out_dt = "int64" if op == "argmax" else dt
                y = ctx.poisoned((rows,), out_dt)
                rtk.reduce(x, op=op, out=y, **_bf(dt))
                tol = 4 * TOL[dt] if op == "sum" else 0.0
                ctx.check(op, y, out_dt, lambda op=op: rw.reduce_reference(x64, op), tol,
                          "exact" if op != "sum" else "max", exact_rerun=True)


@contextlib.contextmanager
def _few_resident_blocks(blocks: int):
    """Prefetching, staged and persistent row kernels size their grid to one resident wave; cap it
    so that every block (cluster) walks many rows and reuses its ring slots and barrier phases."""
    from rtkernels.ops import rowwise as rw
    rw._PLANS.clear()
    try:
        with patched(rw, _resident_blocks=lambda k, cfg: blocks):
            yield
    finally:
        rw._PLANS.clear()


B8 = dict(dtype="bfloat16", vec=8)
# (width, rows, config fields, quick): rows through shared memory (ring_rows: cp.async; bulk_stages:
# cp.async.bulk onto mbarriers) and two-pass rows, on grids of a few blocks.
ROWS_STAGED = (
    (4096, 64, dict(threads_per_row=128, block_size=128, vecs_per_thread=4, ring_rows=3, min_blocks=8), True),
    (4000, 64, dict(threads_per_row=128, block_size=128, vecs_per_thread=4, bulk_stages=2, min_blocks=8), True),
    (1000, 64, dict(threads_per_row=32, block_size=128, vecs_per_thread=4, ring_rows=2, min_blocks=8), False),
    (16000, 24, dict(threads_per_row=512, block_size=512, vecs_per_thread=4, bulk_stages=3, min_blocks=2), False),
    (16384, 24, dict(threads_per_row=256, block_size=256, vecs_per_thread=4, cluster_size=2, ring_rows=2,
                     min_blocks=4, streaming=False), False),
    (33000, 6, dict(threads_per_row=256, block_size=256, vecs_per_thread=4, two_pass=True), False),
)
# Rows split over a cluster of blocks: block totals pushed by st.async (cluster_push), slices in
# shared memory by one bulk copy (smem_rows), persistent clusters walking many rows, and the
# cluster-barrier variant.
ROWS_CLUSTER = (
    (65536, 6, dict(threads_per_row=256, block_size=256, vecs_per_thread=4, cluster_size=8, cluster_push=True,
                    persistent=True, prefetch=True, min_blocks=2), True),
    (60000, 6, dict(threads_per_row=512, block_size=512, vecs_per_thread=4, cluster_size=4, cluster_push=True,
                    persistent=True, min_blocks=2), False),
    (32768, 6, dict(threads_per_row=256, block_size=256, vecs_per_thread=8, cluster_size=2, cluster_push=True,
                    smem_rows=True, min_blocks=6), True),
    (5000, 6, dict(threads_per_row=128, block_size=128, vecs_per_thread=8, cluster_size=2, cluster_push=True,
                   min_blocks=4), False),
    (65536, 6, dict(threads_per_row=256, block_size=256, vecs_per_thread=4, cluster_size=8, persistent=True,
                    prefetch=True, min_blocks=2), False),
)


def _row_configs(ctx: Ctx, table, resident: int):
    from rtkernels.ops.rowwise import NormConfig, SoftmaxConfig
    with _few_resident_blocks(resident):
        for n, rows, fields, quick in table:
            if not ctx.variant(f"{n}x{rows} " + " ".join(f"{k}={v}" for k, v in fields.items()), quick=quick):
                continue
            x, x64 = _rows(ctx, "bfloat16", rows, n, True, specials=True)
            _softmax_variant(ctx, x, x64, "bfloat16", config=SoftmaxConfig(**B8, **fields))
            x, x64 = _rows(ctx, "bfloat16", rows, n, True)
            nf = dict(fields)
            if 65536 // (nf["block_size"] * nf.get("min_blocks", 1)) <= 80:
                nf["param_slots"] = 1                      # the norms' weights within the register cap
            ncfg = NormConfig(**B8, weight_dtype="bfloat16", **nf)
            _norm_variants(ctx, x, x64, "bfloat16", "bfloat16", config=ncfg)


@case("rows_staged", families=("softmax", "norm"), ops=("softmax", "rmsnorm", "layernorm"),
      note="row kernels staging rows through shared memory (cp.async ring, bulk copies) and two-pass rows")
def _rows_staged(ctx: Ctx):
    from rtkernels import device
    if device.current_arch() not in ("sm_90", "sm_90a"):
        ctx.skip("bulk_stages and clusters need sm_90")
    _row_configs(ctx, ROWS_STAGED, resident=4)


@case("rows_cluster", families=("softmax", "norm"), ops=("softmax", "rmsnorm", "layernorm"),
      note="wide rows over clusters of blocks (distributed shared memory, st.async, mbarriers)")
def _rows_cluster(ctx: Ctx):
    ctx.require_sm90()
    _row_configs(ctx, ROWS_CLUSTER, resident=8)
    # the heuristics' own cluster picks for wide rows, few rows (reduce spreads those over clusters)
    for n in (32768, 65536, 70001, 131072):
        if not ctx.variant(f"heuristic 3x{n}", quick=n == 70001):
            continue
        x, x64 = _rows(ctx, "bfloat16", 3, n, False, specials=True)
        _softmax_variant(ctx, x, x64, "bfloat16")
        x, x64 = _rows(ctx, "bfloat16", 3, n, False)
        _norm_variants(ctx, x, x64, "bfloat16", "bfloat16")


# ---- cases: attention merge and KV-cache decoding ----------------------------------------------
def _merge_array(ctx: Ctx, shape, dt, wide, nan_rows):
    """(o, parent, float64 copy of o): random rows, NaN in ``nan_rows`` (empty rows: the op never
    reads their o); ``wide`` > 0: o is a head-dim slice of rows ``wide`` elements wider."""
    h = ctx.rng.standard_normal(shape[:-1] + (shape[-1] + wide,))
    h[:, nan_rows] = np.nan
    parent, h64 = ctx.upload(h, dt)
    d = shape[-1]
    return (parent[..., :d] if wide else parent), parent, h64[..., :d].copy()


def _merge_lse(ctx: Ctx, shape, empty_rows):
    h = ctx.rng.standard_normal(shape) * 3
    h[:, :, empty_rows] = -np.inf
    h = h.astype(np.float32)
    return ctx.cp.asarray(h), h.astype(np.float64)


# (label, batch, seqlen, nheads, head_dim, (lo, hi) or None, dtype of a (None: no a), of b, of out
# (None: in place into a), wide, quick)
MERGE_VARIANTS = (
    ("f32 += bf16 in place d40 strided rows 3..33", 2, 37, 3, 40, (3, 33), "float32", "bfloat16", None, 8, True),
    ("f32, f16 -> f16 d5 all rows", 1, 19, 2, 5, None, "float32", "float16", "float16", 0, False),
    ("no a, bf16 -> f32 d128", 2, 20, 2, 128, None, None, "bfloat16", "float32", 0, True),
    ("bf16, bf16 -> bf16 d24 strided rows 1..16", 1, 17, 3, 24, (1, 16), "bfloat16", "bfloat16", "bfloat16", 8, False),
)


@case("attention_merge", families=("attention_merge",), ops=("attention_merge",),
      note="in place, into another dtype, without a, strided rows, empty (-inf) rows holding NaN")
def _attention_merge(ctx: Ctx):
    import rtkernels as rtk
    from rtkernels.ops.attention_merge import attention_merge_reference
    for label, b, s, h, d, rows, dt_a, dt_b, dt_o, wide, quick in MERGE_VARIANTS:
        if not ctx.variant(label, quick=quick):
            continue
        lo, hi = rows or (0, s)
        n = hi - lo
        # empty rows inside the block: one in a, one in b, one in both
        ea, eb, e2 = lo + n // 4, lo + n // 2, lo + 3 * n // 4
        a = a_parent = a64 = la = la64 = None
        if dt_a is not None:
            a, a_parent, a64 = _merge_array(ctx, (b, s, h, d), dt_a, wide, [ea, e2])
            la, la64 = _merge_lse(ctx, (b, h, s), [ea, e2])
        bb, _, b64 = _merge_array(ctx, (b, n, h, d), dt_b, wide, [eb - lo, e2 - lo])
        lb, lb64 = _merge_lse(ctx, (b, h, n), [eb - lo, e2 - lo])
        bf = {"dtype": "bfloat16"} if "bfloat16" in (dt_a, dt_b, dt_o) else {}
        ref_o, ref_lse = attention_merge_reference(a64, la64, b64, lb64, rows=rows)
        if dt_o is None:                   # in place: rows outside the block are left as they were
            rtk.attention_merge(a, la, bb, lb, rows=rows, **bf)
            got = a_parent.get()[..., :d]  # (the contiguous parent: a view's download is a CuPy kernel)
            ctx.check("o", got[:, lo:hi], dt_a, ref_o[:, lo:hi], 2 * TOL[dt_a], exact_rerun=True)
            rest = np.r_[0:lo, hi:s]
            ctx.check("o outside the block", got[:, rest], dt_a, a64[:, rest], 0, "exact")
            ctx.check("lse", la, "float32", ref_lse, 1e-5, exact_rerun=True)
            continue
        out, lse_out = ctx.poisoned((b, s, h, d), dt_o), ctx.poisoned((b, h, s), "float32")
        got, got_lse = rtk.attention_merge(a, la, bb, lb, rows=rows, out=out, lse_out=lse_out, **bf)
        assert got is out and got_lse is lse_out
        ctx.check("o", out, dt_o, ref_o, 2 * TOL[dt_o], exact_rerun=True)
        ctx.check("lse", lse_out, "float32", ref_lse, 1e-5, exact_rerun=True)


# (label, batch, seqlen_q, nheads, nheads_kv, head_dim, dtype, page_size (None: contiguous), lens,
# seqlen_new, capacity, causal, num_splits, quick).  Paged caches get shuffled pages, spare pages
# and table entries far out of range past each sequence's pages (never to be read).
KVCACHE_VARIANTS = (
    ("bf16 decode contiguous GQA2 d64", 3, 1, 4, 2, 64, "bfloat16", None, (0, 1, 40), 0, 45, True, None, True),
    ("f16 paged16 append 3 across pages d40", 2, 3, 4, 1, 40, "float16", 16, (13, 30), 3, 50, True, None, True),
    ("bf16 paged32 splits=3 d128", 2, 2, 2, 2, 128, "bfloat16", 32, (290, 5), 0, 300, True, 3, False),
    ("f16 contiguous splits=2 append 2 non-causal d96", 2, 4, 6, 3, 96, "float16", None, (7, 60), 2, 70, False, 2,
     False),
    # the keys mode's last CTA merging 16 splits in one round trip (the group merge's loads)
    ("bf16 keys B1 GQA4 16-split one-trip merge d128", 1, 1, 8, 2, 128, "bfloat16", None, (700,), 0, 720, False, 16,
     True),
    # the keys mode's cluster merge (2-8 splits of a group merged through distributed shared memory,
    # since the twenty-fourth session): 8 splits, an append, a sequence without keys
    ("bf16 keys GQA4 8-split cluster merge append 1 d128", 2, 1, 8, 2, 128, "bfloat16", None, (700, 0), 1, 720, True,
     8, True),
    # ... and its group merge where 16 splits x 16 rows of partials (128 KB a group) would go to the
    # combine launch: a cooperative grid, a barrier per group
    ("bf16 keys Sq4 GQA4 16-split group merge d128", 1, 4, 8, 2, 128, "bfloat16", None, (700,), 0, 720, True, 16, True),
    # the wgmma rows mode (sm_90, head_dim <= 128): 17-32 rows per kv head on a contiguous cache,
    # and more than 32 on a paged one, with query rows that see no key (Sq > cache + new, causal)
    ("bf16 wgmma rows contiguous Sq8 GQA4 d128", 2, 8, 8, 2, 128, "bfloat16", None, (37, 150), 0, 160, True, None,
     True),
    # (paged, 3 splits: the group merge - a cooperative launch, a barrier per group)
    ("f16 wgmma rows paged16 Sq16 GQA4 append 2 splits=3 group merge d64", 2, 16, 4, 1, 64, "float16", 16, (70, 3),
     2, 90, True, 3, True),
    # 2 splits: the cluster merge (each pair of splits one cluster, merged through distributed shared
    # memory), a split without keys
    ("bf16 wgmma rows paged16 Sq16 GQA4 append 2 2-split cluster merge d128", 2, 16, 8, 2, 128, "bfloat16", 16,
     (900, 0), 2, 1000, True, 2, True),
    # the defaults of 2026-11-26: a d128 rows grid split to one CTA per SM (2 splits of 64 rows: the
    # 64 KB of partials merged in the launch, from the last CTA's registers since the fifteenth
    # session, through a cluster's shared memory since the twenty-third), and two-warp CTAs for a contiguous grid of more than one CTA per SM (35 x 4 = 140 CTAs)
    ("bf16 wgmma rows contiguous Sq16 GQA4 fused 2-split merge d128", 2, 16, 8, 2, 128, "bfloat16", None, (2047, 900),
     0, 2100, True, None, True),
    # the group merge (from 3 splits since the nineteenth session): 4 splits at d128 (4 units a
    # round trip), 48 of 64 rows, a split without keys; and 17 splits (two batches of loads)
    ("bf16 wgmma rows contiguous Sq12 GQA4 4-split group merge d128", 2, 12, 8, 2, 128, "bfloat16", None,
     (700, 30), 0, 720, True, 4, True),
    ("bf16 wgmma rows contiguous Sq16 GQA4 17-split group merge d128", 1, 16, 8, 2, 128, "bfloat16", None,
     (3000,), 0, 3100, True, 17, True),
    ("bf16 decode contiguous two-warp CTAs d64", 35, 1, 8, 4, 64, "bfloat16", None, tuple(range(0, 70, 2)), 1, 80,
     True, None, True),
    # page ids read a batch (32 16-key groups) ahead: a keys-mode warp and a rows-mode CTA cross
    # several batches, lengths end inside one
    ("bf16 keys paged16 page-id batches d128", 2, 1, 8, 2, 128, "bfloat16", 16, (4100, 1333), 0, 4200, True, 1,
     True),
    ("bf16 wgmma rows paged16 Sq16 GQA4 page-id batches d128", 2, 16, 8, 2, 128, "bfloat16", 16, (1800, 700), 0,
     1900, True, 1, True),
)


@case("attention_dense_decode", families=("attention_decode",), ops=("attention",),
      note="rtk.attention with few query rows: the decode kernel over the whole k / v (no cache_seqlens read)")
def _attention_dense_decode(ctx: Ctx):
    import rtkernels as rtk
    from rtkernels.ops import attention_kvcache as kv
    from rtkernels.ops.attention import decode_route
    for label, batch, sq, h, hkv, d, dt, sk, causal in (("gqa", 2, 1, 16, 4, 128, "bfloat16", 4100, True),
                                                        ("rows", 1, 16, 8, 2, 64, "float16", 33000, False)):
        if not ctx.variant(label, quick=True):
            continue
        assert decode_route(batch, sq, sk, h, hkv, d), label
        q, q64 = ctx.randn((batch, sq, h, d), dt)
        k, k64 = ctx.randn((batch, sk, hkv, d), dt)
        v, v64 = ctx.randn((batch, sk, hkv, d), dt)
        out = ctx.poisoned((batch, sq, h, d), dt)
        o, lse = rtk.attention(q, k, v, causal=causal, out=out, **_bf(dt))
        ref = kv.attention_kvcache_reference(q64, k64, v64, None, causal=causal)
        ctx.check("o", o, dt, ref[0], ATT_TOL[dt], "norm", exact_rerun=True)
        ctx.check("lse", lse, "float32", ref[1], 1e-3, exact_rerun=True)


@case("attention_kvcache", families=("attention_decode",), ops=("attention_kvcache",),
      note="contiguous and paged caches, k_new appended across pages, split keys with lse (the combine, the "
           "last CTA's merges, the keys mode's one-trip, cluster and group merges, the rows mode's group and cluster merges)")
def _attention_kvcache(ctx: Ctx):
    import rtkernels as rtk
    from rtkernels.ops import attention_kvcache as kv
    for label, batch, sq, h, hkv, d, dt, page, lens, new, cap, causal, splits, quick in KVCACHE_VARIANTS:
        if not ctx.variant(label, quick=quick):
            continue
        lens_h = np.asarray(lens, np.int32)
        q, q64 = ctx.randn((batch, sq, h, d), dt)
        table = table_h = None
        if page is None:
            kc, kc64 = ctx.randn((batch, cap, hkv, d), dt)
            vc, vc64 = ctx.randn((batch, cap, hkv, d), dt)
        else:
            per_seq = -(-cap // page)
            nblk = batch * per_seq + 3
            kc, kc64 = ctx.randn((nblk, page, hkv, d), dt)
            vc, vc64 = ctx.randn((nblk, page, hkv, d), dt)
            table_h = np.full((batch, per_seq + 2), 1 << 30, np.int32)
            ids = ctx.rng.permutation(nblk)[: batch * per_seq].reshape(batch, per_seq)
            for bi in range(batch):
                used = -(-(int(lens_h[bi]) + new) // page)
                table_h[bi, :used] = ids[bi, :used]
            table = ctx.cp.asarray(table_h)
        kn = vn = kn64 = vn64 = None
        if new:
            kn, kn64 = ctx.randn((batch, new, hkv, d), dt)
            vn, vn64 = ctx.randn((batch, new, hkv, d), dt)
        out = ctx.poisoned((batch, sq, h, d), dt)
        o, lse = rtk.attention_kvcache(q, kc, vc, ctx.cp.asarray(lens_h), k_new=kn, v_new=vn, block_table=table,
                                       causal=causal, return_lse=True, num_splits=splits, out=out, **_bf(dt))
        assert o is out
        ref = {}

        def reference(i):
            if not ref:
                ref["v"] = kv.attention_kvcache_reference(q64, kc64, vc64, lens_h, k_new=kn64, v_new=vn64,
                                                          block_table=table_h, causal=causal)
            return ref["v"][i]
        ctx.check("o", o, dt, lambda: reference(0), ATT_TOL[dt], "norm", exact_rerun=True)
        ctx.check("lse", lse, "float32", lambda: reference(1), 1e-3, exact_rerun=True)
        if new:   # k_new / v_new written into the cache at cache_seqlens, nothing else touched
            want_k, want_v = kv.append_kvcache_reference(kc64, vc64, lens_h, kn64, vn64, table_h)
            ctx.check("k_cache", kc, dt, want_k, 0, "exact")
            ctx.check("v_cache", vc, dt, want_v, 0, "exact")


# ---- cases: training ops -----------------------------------------------------------------------
# (dtype, rows, width, weight dtype, saved statistics, quick): widths from one element to a ragged
# 4097; rows of odd widths are slices of wider rows; float32 weights with 16-bit rows.
NORM_BWD_VARIANTS = (
    ("bfloat16", 37, 1, "bfloat16", False, False),
    ("float16", 9, 7, "float32", True, False),
    ("bfloat16", 67, 33, "bfloat16", True, True),
    ("float32", 9, 1000, "float32", False, False),
    ("bfloat16", 5, 4097, "float32", False, True),
    ("float32", 3, 8191, "float32", True, False),
    ("bfloat16", 300, 4096, "bfloat16", True, True),    # block rows: the column sums in the rows kernel's tail
)


@case("norm_backward", families=("norm_bwd",), ops=("rmsnorm_backward", "layernorm_backward"),
      note="dx and the two-stage (rows, then column sums) dweight / dbias; with and without saved statistics")
def _norm_backward(ctx: Ctx):
    for dt, rows, n, wdt, stats, quick in NORM_BWD_VARIANTS:
        if not ctx.variant(f"{dt} {rows}x{n} w={wdt}{' stats' if stats else ''}", quick=quick):
            continue
        _norm_bwd_variant(ctx, dt, rows, n, wdt, stats, n % 2 == 1)


# Bulk-copy stages (bulk_rows, sm_90) forced on the width's heuristic tile (both ops): (width, rows,
# config fields, saved statistics, quick).  Few rows per worker, where the first version left
# stages armed for rows past the end unwaited (synccheck "Missing wait", H200 2026-11-26: 4k
# LayerNorm, 300 rows); lane groups without a row; one row; one stage; cluster rows.  Those arm
# their stages in start() only; the two rows-many cases wrap every stage several times (release()
# re-arms a stage its team has waited on), with and without saved statistics.  (The second "Missing
# wait", the statistics' cp.async onto the stage barrier, showed in every case with statistics.)
NORM_BWD_BULK = (
    (4096, 300, dict(bulk_rows=2, acc_smem=False, min_blocks=1), True, True),   # the 4k LayerNorm candidate
    (4096, 2000, dict(bulk_rows=2, acc_smem=False, min_blocks=1), True, False),  # its steady state
    (4096, 7, dict(bulk_rows=2, acc_smem=False, min_blocks=1), False, False),
    (1024, 33, dict(bulk_rows=3), True, True),          # 4 lane groups per block: teams without rows
    (1024, 4097, dict(bulk_rows=3), False, False),      # lane groups over many wraps, ragged last round
    (1000, 1, dict(bulk_rows=1), False, False),         # ragged lane-group row, one stage
    (16384, 9, dict(bulk_rows=2), True, False),         # cluster rows, sums in shared memory
)


@case("norm_backward_bulk", families=("norm_bwd",), ops=("rmsnorm_backward", "layernorm_backward"),
      note="the norm backward's bulk-copy stages (cp.async.bulk onto mbarriers): few rows per worker, and wraps")
def _norm_backward_bulk(ctx: Ctx):
    from rtkernels import device
    from rtkernels.ops import rowwise_bwd as rb
    ctx.require_sm90()
    arch = device.current_arch()
    for n, rows, fields, stats, quick in NORM_BWD_BULK:
        if not ctx.variant(f"bfloat16 {rows}x{n} " + " ".join(f"{k}={v}" for k, v in fields.items())
                           + (" stats" if stats else ""), quick=quick):
            continue
        configs = [rb.plan_bwd("norm_bwd", n, "bfloat16", 8, arch, weight_dtype="bfloat16", layer=layer)
                   .replace(**fields) for layer in (False, True)]
        _norm_bwd_variant(ctx, "bfloat16", rows, n, "bfloat16", stats, False, configs)


def _norm_bwd_variant(ctx: Ctx, dt, rows, n, wdt, stats, strided, configs=(None, None)):
    """rmsnorm_backward then layernorm_backward of one shape against the float64 references;
    configs: (RMSNorm's, LayerNorm's) NormBwdConfig or None (the heuristic)."""
    import rtkernels as rtk
    from rtkernels.ops import rowwise_bwd as rb
    x, x64 = _rows(ctx, dt, rows, n, strided)
    dy, dy64 = ctx.randn((rows, n), dt)
    w, w64 = ctx.randn((n,), wdt)
    b, _ = ctx.randn((n,), wdt)
    rstd = mean = None
    if stats:   # the forward's float32 statistics, computed here (no forward kernel)
        rstd = ctx.cp.asarray((1 / np.sqrt(np.mean(x64 ** 2, -1) + 1e-6)).astype(np.float32))
    dx = ctx.poisoned((rows, n), dt)
    got_dx, got_dw = rtk.rmsnorm_backward(dy, x, w, rstd, eps=1e-6, out=dx, config=configs[0], **_bf(dt))
    assert got_dx is dx
    ref = rb.rmsnorm_backward_reference(dy64, x64, w64, 1e-6)
    ctx.check("rms dx", dx, dt, ref[0], 4 * TOL[dt], exact_rerun=True)
    ctx.check("rms dweight", got_dw, wdt, ref[1], 4 * TOL[wdt], exact_rerun=True)
    if stats:
        m64 = np.mean(x64, -1)
        mean = ctx.cp.asarray(m64.astype(np.float32))
        rstd = ctx.cp.asarray((1 / np.sqrt(np.mean((x64 - m64[:, None]) ** 2, -1) + 1e-5)).astype(np.float32))
    dx = ctx.poisoned((rows, n), dt)
    got_dx, got_dw, got_db = rtk.layernorm_backward(dy, x, w, b, mean, rstd, eps=1e-5, out=dx, config=configs[1],
                                                    **_bf(dt))
    ref = rb.layernorm_backward_reference(dy64, x64, w64, 1e-5)
    ctx.check("ln dx", dx, dt, ref[0], 4 * TOL[dt], exact_rerun=True)
    ctx.check("ln dweight", got_dw, wdt, ref[1], 4 * TOL[wdt], exact_rerun=True)
    ctx.check("ln dbias", got_db, wdt, ref[2], 4 * TOL[wdt], exact_rerun=True)


@case("softmax_backward", families=("softmax_bwd",), ops=("softmax_backward",))
def _softmax_backward(ctx: Ctx):
    import rtkernels as rtk
    from rtkernels.ops import rowwise as rw, rowwise_bwd as rb
    for dt in ("float16", "bfloat16", "float32"):
        for rows, n in ((7, 1), (5, 33), (9, 1000), (3, 4097), (2, 16385)):
            if not ctx.variant(f"{dt} {rows}x{n}", quick=n in (33, 4097) and dt == "bfloat16"):
                continue
            _, x64 = ctx.randn((rows, n), dt, scale=3.0)
            dy, dy64 = _rows(ctx, dt, rows, n, n % 2 == 1)
            metric = "norm" if n > 1 else "max"      # (one column: dx is 0)
            for log in (False, True):
                y, y64 = ctx.upload(rw.softmax_reference(x64, log_softmax=log), dt)   # as a forward stores it
                dx = ctx.poisoned((rows, n), dt)
                assert rtk.softmax_backward(dy, y, log=log, out=dx, **_bf(dt)) is dx
                ctx.check("log_softmax dx" if log else "softmax dx", dx, dt,
                          lambda log=log, y64=y64: rb.softmax_backward_reference(dy64, y64, log=log),
                          4 * TOL[dt], metric, exact_rerun=True)


# (dtype, rows, vocab, target dtype, ignore_index, label_smoothing, reduction, quick)
CE_VARIANTS = (
    ("bfloat16", 9, 1001, "int64", -100, 0.0, "mean", True),
    ("float32", 5, 1, "int64", -100, 0.0, "sum", False),
    ("bfloat16", 6, 33, "int32", -1, 0.1, "none", False),
    ("float16", 3, 32771, "int64", -100, 0.2, "mean", True),
    ("float32", 4, 4099, "int64", -100, 0.0, "mean", False),    # every target ignored: mean = NaN
)


@case("cross_entropy", families=("cross_entropy",), ops=("cross_entropy",),
      note="loss and gradient in one pass: odd vocabularies, ignored targets, smoothing, every reduction")
def _cross_entropy(ctx: Ctx):
    import rtkernels as rtk
    from rtkernels.ops import cross_entropy as ce
    for dt, rows, v, tdt, ignore, smoothing, reduction, quick in CE_VARIANTS:
        label = f"{dt} {rows}x{v} {tdt} ignore={ignore} eps={smoothing} {reduction}"
        if not ctx.variant(label, quick=quick):
            continue
        x, x64 = ctx.randn((rows, v), dt, scale=3.0)
        t = ctx.rng.integers(0, v, rows)
        t[ctx.rng.random(rows) < 0.3] = ignore
        t[0] = v - 1                                      # the last class (in a ragged tail when v is odd)
        if v == 4099:
            t[:] = ignore
        g = ctx.poisoned((rows, v), dt)
        loss, got_g = rtk.cross_entropy(x, ctx.cp.asarray(t.astype(tdt)), ignore_index=ignore,
                                        label_smoothing=smoothing, reduction=reduction, return_grad=True, grad_out=g,
                                        **_bf(dt))
        assert got_g is g
        ref_l, ref_g = ce.cross_entropy_reference(x64, t, ignore_index=ignore, label_smoothing=smoothing,
                                                  reduction=reduction)
        ctx.check("loss", loss, "float32", np.asarray(ref_l), 1e-5 if dt == "float32" else 1e-4, exact_rerun=True)
        ctx.check("dlogits", g, dt, ref_g, 4 * TOL[dt], "norm" if np.any(ref_g) else "max", exact_rerun=True)
        if quick:   # the loss-only kernel
            alone = rtk.cross_entropy(x, ctx.cp.asarray(t.astype(tdt)), ignore_index=ignore,
                                      label_smoothing=smoothing, reduction=reduction, **_bf(dt))
            ctx.check("loss without the gradient", alone, "float32", np.asarray(ref_l),
                      1e-5 if dt == "float32" else 1e-4, exact_rerun=True)


ADAMW_SHAPES = ((1,), (7,), (33, 5), (3, 7, 11), (1000,), (129, 65))
# (label, param dtype, grad dtype, state dtype, master weights, maximize, an unaligned view, quick)
ADAMW_VARIANTS = (
    ("f32", "float32", "float32", "float32", False, False, True, True),
    ("bf16 params, fp32 masters and states", "bfloat16", "bfloat16", "float32", True, False, False, True),
    ("f16 params, f16 states, maximize", "float16", "float16", "float16", False, True, True, False),
)


@case("adamw", families=("adamw",), ops=("adamw_step",),
      note="one multi-tensor launch per dtype group: mixed shapes, fp32 masters, an unaligned view (scalar path)")
def _adamw(ctx: Ctx):
    import rtkernels as rtk
    from rtkernels.ops import adamw as aw
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05)
    for label, pdt, gdt, sdt, master, maximize, unaligned, quick in ADAMW_VARIANTS:
        if not ctx.variant(label, quick=quick):
            continue
        ps, gs, ms, vs, mas, start = [], [], [], [], [], []
        for shape in ADAMW_SHAPES + (((1001,),) if unaligned else ()):
            numel = int(np.prod(shape))
            p64 = ctx.rng.standard_normal(shape)
            if unaligned and shape == (1001,):      # one element into its allocation: 4- or 2-byte aligned
                parent, parent64 = ctx.upload(np.concatenate([[0.0], p64]), pdt)
                p, p64 = parent[1:], parent64[1:]
            else:
                p, p64 = ctx.upload(p64, pdt)
            g, g64 = ctx.randn(shape, gdt)
            m, m64 = ctx.upload(ctx.rng.standard_normal(shape) * 0.1, sdt)
            v, v64 = ctx.upload(ctx.rng.random(shape) * 0.01, sdt)
            if master:
                ma, p64 = ctx.upload(ctx.rng.standard_normal(shape), "float32")
                p = ctx.upload(p64, pdt)[0]
                mas.append(ma)
            assert p.size == numel
            for lst, x in ((ps, p), (gs, g), (ms, m), (vs, v), (start, (p64, g64, m64, v64))):
                lst.append(x)
        rtk.adamw_step(ps, gs, ms, vs, step=3, maximize=maximize, master_params=mas if master else None, **hyper)
        for i, (p, m, v, (p64, g64, m64, v64)) in enumerate(zip(ps, ms, vs, start)):
            rp, rm, rv = aw.adamw_reference(p64, g64, m64, v64, step=3, maximize=maximize, **hyper)
            if master:
                ctx.check(f"master[{i}]", mas[i], "float32", rp, TOL["float32"], exact_rerun=True)
            ctx.check(f"param[{i}]", p, pdt, rp, 2 * TOL[pdt], exact_rerun=True)
            ctx.check(f"exp_avg[{i}]", m, sdt, rm, 2 * TOL[sdt], exact_rerun=True)
            ctx.check(f"exp_avg_sq[{i}]", v, sdt, rv, 2 * TOL[sdt], exact_rerun=True)


# ---- worker ------------------------------------------------------------------------------------
def _context_alive(cupy) -> bool:
    try:
        cupy.cuda.runtime.deviceSynchronize()
        return True
    except Exception:   # a sticky error (illegal address, launch failure): the context is gone
        return False


class AllocationLog:
    """CuPy allocator for the initcheck worker: every allocation is its own cudaMalloc (as without
    a pool) and is kept until the process ends, so no address is ever handed out twice, and each
    one is logged - address, size, case, variant, and the allocating lines (the innermost rtkernels
    frame and the innermost frame of this file) - one JSON line each.  The driver maps the
    addresses in compute-sanitizer's reports back to these (:func:`findings`)."""

    def __init__(self, path: Path):
        import cupy
        self.cupy = cupy
        self.file = open(path, "a")
        self.keep: list = []
        self.where = ("", "")

    def __call__(self, size: int):
        mem = self.cupy.cuda.memory.Memory(size)
        if size:
            self.keep.append(mem)
            self.file.write(json.dumps([int(mem.ptr), int(size), *self.where, _allocation_site()]) + "\n")
            self.file.flush()
        return self.cupy.cuda.memory.MemoryPointer(mem, 0)


def _allocation_site() -> str:
    """'rtkernels/ops/x.py:123 fn < sanitize.py:456 case_fn': who asked for the memory."""
    frames = traceback.extract_stack(limit=48)[:-1]
    lib = next((f for f in reversed(frames) if f"{os.sep}rtkernels{os.sep}" in f.filename), None)
    gate = next((f for f in reversed(frames) if f.filename == __file__ and f.name not in ("__call__",
                                                                                          "_allocation_site")), None)
    parts = []
    for f in (lib, gate):
        if f is not None:
            name = os.path.relpath(f.filename, REPO) if f.filename.startswith(str(REPO)) else Path(f.filename).name
            parts.append(f"{name}:{f.lineno} {f.name}")
    return " < ".join(parts) or "?"


_ALLOCS: AllocationLog | None = None


def worker(cases: list[str], phase: str, refs_dir: Path, results: Path, quick: bool, allocs: str = "") -> int:
    """Run ``cases`` in this process; one JSON line per case into ``results``.  ``allocs``: log
    every allocation there, and free none (initcheck: see :class:`AllocationLog`)."""
    global _ALLOCS
    import cupy
    if allocs:
        _ALLOCS = AllocationLog(Path(allocs))
        cupy.cuda.set_allocator(_ALLOCS)
    else:
        cupy.cuda.set_allocator(None)      # no pool: every array is its own allocation (see the docstring)
    failed = False
    with open(results, "a") as out:
        for name in cases:
            out.write(json.dumps(dict(case=name, started=True)) + "\n")   # a crash is then this case's
            out.flush()
            t0 = time.time()
            rec = dict(case=name, phase=phase, ok=True, error=None, skipped=None, checks=[])
            ctx = None
            dead = False
            try:
                if _ALLOCS is not None:
                    _ALLOCS.where = (name, "")
                ctx = Ctx(name, phase, refs_dir, quick)
                CASES[name].fn(ctx)
                cupy.cuda.runtime.deviceSynchronize()
            except Skip as e:
                rec["skipped"] = str(e)
            except Exception as e:   # a case's error is its result; the next case still runs
                rec["ok"] = False
                rec["error"] = "".join(traceback.format_exception_only(type(e), e)).strip()
                rec["traceback"] = traceback.format_exc(limit=8)
                dead = not _context_alive(cupy)
            if ctx is not None:
                rec["checks"] = ctx.checks
                if not dead:
                    ctx.save()
            rec["ok"] = rec["ok"] and all(c["ok"] for c in rec["checks"])
            rec["seconds"] = round(time.time() - t0, 2)
            failed |= not rec["ok"]
            out.write(json.dumps(rec) + "\n")
            out.flush()
            print(f"[{phase}] {name}: {'ok' if rec['ok'] else 'FAILED'} ({len(rec['checks'])} checks, "
                  f"{rec['seconds']} s){' ' + rec['error'] if rec['error'] else ''}", flush=True)
            if dead:
                return DEAD_EXIT
    return 1 if failed else 0


# ---- driver: sanitizer runs and their logs -----------------------------------------------------
def find_sanitizer(given: str | None) -> str | None:
    """compute-sanitizer: --sanitizer, $COMPUTE_SANITIZER, PATH, then the CUDA install folders."""
    for c in (given, os.environ.get("COMPUTE_SANITIZER"), shutil.which("compute-sanitizer"),
              "/usr/local/cuda/bin/compute-sanitizer",
              *sorted(Path("/usr/local").glob("cuda-*/bin/compute-sanitizer"), reverse=True),
              *sorted(Path("/opt/nvidia").glob("*/compute-sanitizer/compute-sanitizer"), reverse=True)):
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return str(c)
    return None


# The preflight's target: one allocation, so the program makes a CUDA context.  compute-sanitizer
# fails a target that ends before its first CUDA call ("Target application terminated before first
# instrumented API call", exit code 255: `python -c pass` under 2025.3.1, H100, 2026-11-27), so the
# preflight over `python -c pass` failed on every tool and dropped to its note.
PREFLIGHT_TARGET = "import cupy; cupy.zeros(1); cupy.cuda.Device().synchronize()"


def preflight(sanitizer: str, tool: str, flags: list[str]) -> tuple[list[str], str | None]:
    """The tool's optional flags this compute-sanitizer accepts: a run over a one-allocation CuPy
    program with all of them, else without them (and a note saying so, with why)."""
    why = ""
    for extra in (flags, []):
        try:
            p = subprocess.run([sanitizer, "--tool", tool, *extra, sys.executable, "-c", PREFLIGHT_TARGET],
                               capture_output=True, text=True, timeout=180)
        except subprocess.TimeoutExpired:
            why = why or "timed out after 180 s"
            continue
        if p.returncode == 0:
            return extra, None if extra == flags else f"{tool}: {' '.join(flags)} refused, run without ({why})"
        tail = [ln.strip() for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
        why = why or f"exit code {p.returncode}: {tail[-1][:200] if tail else 'no output'}"
    return flags, f"{tool}: the preflight run of compute-sanitizer failed ({why}); the cases run with every flag"


_NOT_ERRORS = re.compile(r"^(COMPUTE-SANITIZER|ERROR SUMMARY|RACECHECK SUMMARY|LEAK SUMMARY|Target application|"
                         r"Saved host backtrace|Program hit|Warning|No \w+ errors|Process didn't terminate|"
                         r"Error: process didn't terminate)", re.I)
_SUMMARY = re.compile(r"ERROR SUMMARY:\s*(\d+) errors?", re.I)
_RACE_SUMMARY = re.compile(r"RACECHECK SUMMARY:.*?\((\d+) errors?,\s*(\d+) warnings?\)", re.I)
_HAZARDS = re.compile(r"\[(\d+) hazards?\]")
_UNUSABLE = re.compile(r"device not supported|no supported (cuda )?devices?|unable to (launch|load|initialize)|"
                       r"internal sanitizer error", re.I)


def _blocks(text: str) -> list[list[str]]:
    """A log's reports: a line "========= X" and its indented continuation lines, stripped."""
    blocks: list[list[str]] = []
    for line in text.splitlines():
        if not line.startswith("========="):
            continue
        body = line[9:]
        if body.startswith("     ") and blocks:
            blocks[-1].append(body.strip())
        elif body.strip():
            blocks.append([body.strip()])
    return blocks


def parse_log(text: str, families: dict[str, str]) -> dict:
    """A compute-sanitizer log -> {"by_family": {family: errors}, "warnings": n, "summary": n or None,
    "reports": n, "unusable": line or None}.  A report (a line "========= X" and its indented
    continuation lines) is attributed to the family of the first known kernel name it mentions
    ("cupy" for CuPy's kernels, else "unattributed"); a racecheck analysis report counts its
    "[N hazards]"."""
    by_family: dict[str, int] = {}
    warnings = reports = 0
    summary = unusable = None
    for block in _blocks(text):
        head = block[0]
        m = _SUMMARY.search(head)
        if m:
            summary = max(summary or 0, int(m.group(1)))
        m = _RACE_SUMMARY.search(head)
        if m:
            summary = max(summary or 0, int(m.group(1)))
        if _UNUSABLE.search(head) and unusable is None:
            unusable = head
        if head.lower().startswith("warning"):
            warnings += 1
            continue
        if _NOT_ERRORS.match(head):
            continue
        reports += 1
        text_ = " ".join(block)
        fam = "unattributed"
        for tok in re.findall(r"[A-Za-z_]\w*", text_):
            if tok in families:
                fam = families[tok]
                break
            if tok.startswith("cupy_"):
                fam = "cupy"
                break
        m = _HAZARDS.search(text_)
        by_family[fam] = by_family.get(fam, 0) + (int(m.group(1)) if m else 1)
    return dict(by_family=by_family, warnings=warnings, summary=summary, reports=reports, unusable=unusable)


_ADDRESS = (re.compile(r"Uninitialized access at (0x[0-9a-fA-F]+)"), re.compile(r"Address (0x[0-9a-fA-F]+)"),
            re.compile(r"access to (0x[0-9a-fA-F]+)"))
_KERNEL_PC = re.compile(r"([A-Za-z_]\w*)(?:\([^)]*\))?\+(0x[0-9a-fA-F]+)")
_PC_IN = re.compile(r"\bat (0x[0-9a-fA-F]+) in (?:\S*:\d+:)?([A-Za-z_]\w*)")
_WHO = re.compile(r"by thread \(([^)]*)\) in block \(([^)]*)\)")
_LONG_HEX = re.compile(r"0x[0-9a-fA-F]{9,}")    # addresses (program counters are shorter)


def load_allocations(path: str | Path) -> list[list]:
    """An initcheck worker's allocation log: [address, bytes, case, variant, site] rows, by address."""
    rows = []
    p = Path(path)
    if p.exists():
        for line in p.read_text().splitlines():
            with contextlib.suppress(ValueError):
                rows.append(json.loads(line))
    return sorted(rows, key=lambda r: r[0])


def locate(address: int, allocations: list[list]) -> dict | None:
    """The allocation ``address`` falls in (or, past every one, the nearest below it): its site,
    size, case and variant, and the offset of the address in it."""
    import bisect
    i = bisect.bisect_right([a[0] for a in allocations], address) - 1
    if i < 0:
        return None
    ptr, size, case_name, label, site = allocations[i][:5]
    return dict(site=site, bytes=size, offset=address - ptr, inside=address < ptr + size, case=case_name,
                variant=label)


def findings(text: str, families: dict[str, str], allocations: list[list] | None = None) -> list[dict]:
    """compute-sanitizer's reports grouped into distinct findings: (what, kernel, program counter,
    allocating site) with their count (racecheck: hazards), the byte offsets seen in the allocation,
    its size, the variants whose memory it was and one example thread; most frequent first."""
    groups: dict[tuple, dict] = {}
    for block in _blocks(text):
        head = block[0]
        if _NOT_ERRORS.match(head) or head.lower().startswith("warning") or _SUMMARY.search(head):
            continue
        body = " ".join(block)
        m = _KERNEL_PC.search(body)
        kernel, pc = (m.group(1), m.group(2)) if m else (None, None)
        if m is None:
            m = _PC_IN.search(body)
            if m:
                pc, kernel = m.group(1), m.group(2)
        where = None
        for rx in _ADDRESS:
            a = rx.search(body)
            if a:
                where = locate(int(a.group(1), 16), allocations) if allocations else dict(address=a.group(1))
                break
        what = _LONG_HEX.sub("0x..", head)
        site = (where or {}).get("site")
        key = (what, kernel, pc, site)
        g = groups.get(key)
        if g is None:
            g = groups[key] = dict(n=0, what=what, kernel=kernel, family=families.get(kernel or "", None), pc=pc,
                                   site=site, bytes=None, offsets=None, outside=False, variants=[], example=None)
        h = _HAZARDS.search(body)
        g["n"] += int(h.group(1)) if h else 1
        if where and "offset" in where:
            off = where["offset"]
            lo_hi = g["offsets"] or [off, off]
            g["offsets"] = [min(lo_hi[0], off), max(lo_hi[1], off)]
            g["bytes"] = where["bytes"]
            g["outside"] |= not where["inside"]
            v = f"{where['case']}: {where['variant']}"
            if v not in g["variants"] and len(g["variants"]) < 4:
                g["variants"].append(v)
        if g["example"] is None:
            who = _WHO.search(body)
            g["example"] = (f"thread ({who.group(1)}) block ({who.group(2)})" if who else "") + \
                (f" at {where['address']}" if where and "address" in where else "")
    return sorted(groups.values(), key=lambda g: -g["n"])


def finding_line(tool: str, f: dict) -> str:
    """One line per finding for the summary printed at the end."""
    at = f"{f['kernel']}+{f['pc']}" if f["kernel"] else "(host)"
    what = f["what"].replace("Uninitialized __global__ memory read", "uninit read").replace(
        "Host API memory access error at host access to", "host access to")[:64]
    mem = ""
    if f["site"]:
        span = f"{f['offsets'][0]}..{f['offsets'][1]}" if f["offsets"] else "?"
        mem = f" | {'PAST ' if f['outside'] else ''}bytes {span} of {f['bytes']} from {f['site']}"
    var = f" | {f['variants'][0]}" if f["variants"] else ""
    return f"{tool:9s} {f['n']:6d}x {at} {what}{mem}{var}"[:300]


def _group_name(env: tuple) -> str:
    return "default" if not env else ",".join(f"{k}={v}" for k, v in env)


def _worker_env(env: tuple) -> dict:
    e = dict(os.environ)
    e.update(dict(env))
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), e.get("PYTHONPATH", "")) if p)
    e["PYTHONUNBUFFERED"] = "1"
    return e


def _read_results(path: Path) -> tuple[dict, list[str]]:
    """(case -> result, cases started) from a worker's results file."""
    got, started = {}, []
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                if rec.get("started"):
                    started.append(rec["case"])
                else:
                    got[rec["case"]] = rec
    return got, started


def run_worker(cases: list[str], env: tuple, phase: str, out: Path, tag: str, timeout: float, quick: bool,
               prefix: list[str] | None = None) -> dict:
    """Run ``cases`` in worker processes (under ``prefix``, the sanitizer command, if given) until
    each has a result: a process that dies (or times out) records its running case as crashed and
    the rest start again in a fresh process.  Returns {"results", "logs", "returncodes", "seconds"}."""
    results: dict[str, dict] = {}
    logs, codes, allocs = [], [], []
    todo = list(cases)
    t0 = time.time()
    attempt = 0
    while todo:
        res_path = out / f"{tag}.{attempt}.jsonl"
        res_path.unlink(missing_ok=True)
        stdout_path = out / f"{tag}.{attempt}.out"
        cmd = list(prefix or [])
        if prefix:
            log_path = out / f"{tag}.{attempt}.log"
            cmd[cmd.index("{log}")] = str(log_path)
            logs.append(str(log_path))
        cmd += [sys.executable, str(Path(__file__).resolve()), "--worker", "--phase", phase, "--cases", ",".join(todo),
                "--refs", str(out / "refs"), "--results", str(res_path)] + (["--quick"] if quick else [])
        if phase in ALLOCATION_LOG_TOOLS:
            alloc_path = out / f"{tag}.{attempt}.allocs.jsonl"
            alloc_path.unlink(missing_ok=True)
            allocs.append(str(alloc_path))
            cmd += ["--allocs", str(alloc_path)]
        left = timeout - (time.time() - t0)
        with open(stdout_path, "w") as so:
            try:
                p = subprocess.run(cmd, env=_worker_env(env), stdout=so, stderr=subprocess.STDOUT,
                                   timeout=max(left, 1.0), cwd=str(REPO))
                code = p.returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
        codes.append(code)
        got, started = _read_results(res_path)
        results.update(got)
        todo = [c for c in todo if c not in got]
        running = [c for c in started if c not in got]
        if running:
            # the case that was running when the process ended (a worker whose context died after a
            # case has recorded that case and started nothing more: the rest simply go again)
            crashed = running[-1]
            todo.remove(crashed)
            tail = stdout_path.read_text(errors="replace")[-2000:] if stdout_path.exists() else ""
            results[crashed] = dict(case=crashed, phase=phase, ok=False, checks=[], skipped=None,
                                    error=f"worker ended ({'timeout' if code == 'timeout' else f'exit {code}'}) "
                                          f"while running this case", tail=tail)
        elif todo and not got:
            # nothing started at all (the interpreter or the sanitizer failed first): do not loop
            tail = stdout_path.read_text(errors="replace")[-2000:] if stdout_path.exists() else ""
            for c in todo:
                results[c] = dict(case=c, phase=phase, ok=False, checks=[], skipped=None,
                                  error=f"worker ended (exit {code}) before running any case", tail=tail)
            todo = []
        if todo:
            if code == "timeout":
                for c in todo:
                    results[c] = dict(case=c, phase=phase, ok=False, checks=[], skipped=None,
                                      error="not run: the time limit ran out")
                todo = []
        attempt += 1
    return dict(results=results, logs=logs, allocs=allocs, returncodes=codes, seconds=round(time.time() - t0, 1))


def environment(sanitizer: str | None) -> dict:
    env = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), python=sys.version.split()[0])
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
        env["gpu"] = out.splitlines()[0] if out else None
    except Exception:
        env["gpu"] = None
    if sanitizer:
        try:
            v = subprocess.run([sanitizer, "--version"], capture_output=True, text=True, timeout=60).stdout
            env["sanitizer"] = next((f"compute-sanitizer {line.split()[1]}" for line in v.splitlines()
                                     if line.startswith("Version") and len(line.split()) > 1), v.strip() or None)
        except Exception:
            env["sanitizer"] = None
    return env


# ---- driver: the gate --------------------------------------------------------------------------
def select(only: list[str] | None) -> list[Case]:
    if not only:
        return list(CASES.values())
    picked = []
    for name in only:
        hits = [c for c in CASES.values() if c.name == name] or [c for c in CASES.values() if name in c.families]
        if not hits:
            raise SystemExit(f"sanitize: --only {name!r} is neither a case nor a family of one; cases: "
                             f"{', '.join(CASES)}")
        picked += [c for c in hits if c not in picked]
    return picked


def _cell(errors: int | None, failed: int) -> str:
    s = "-" if errors is None else str(errors)
    return s + (f" +{failed}f" if failed else "")


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"   # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows])


def run_gate(args) -> int:
    out = Path(args.out).resolve()
    (out / "refs").mkdir(parents=True, exist_ok=True)
    chosen = select(args.only)
    notes, runnable = [], []
    for c in chosen:
        missing = missing_requirements(c)
        if missing:
            notes.append(f"{c.name}: skipped, rtkernels has no {', '.join(missing)} yet")
        else:
            runnable.append(c)
    sanitizer = None
    if args.tools:
        sanitizer = find_sanitizer(args.sanitizer)
        if sanitizer is None:
            print("sanitize: compute-sanitizer not found (--sanitizer PATH or $COMPUTE_SANITIZER)", file=sys.stderr)
            return 2
    fams = kernel_families()
    log = dict(environment=environment(sanitizer), args=vars(args), notes=notes,
               cases={c.name: dict(families=c.families, ops=c.ops, env=dict(c.env), note=c.note) for c in runnable},
               phases={})
    t_start = time.time()

    # plain: one process per case, in parallel (compiles, checks, references)
    jobs = args.jobs or max(1, min(8, (os.cpu_count() or 2) // 2))
    print(f"plain run of {len(runnable)} cases ({jobs} processes)", flush=True)
    with ThreadPoolExecutor(jobs) as pool:
        runs = list(pool.map(lambda c: run_worker([c.name], c.env, "plain", out, f"plain-{c.name}", args.timeout,
                                                  False), runnable))
    plain = {}
    for r in runs:
        plain.update(r["results"])
    log["phases"]["plain"] = dict(results=plain, seconds=round(time.time() - t_start, 1))

    groups: dict[tuple, list[str]] = {}
    for c in runnable:
        groups.setdefault(c.env, []).append(c.name)
    flags = {}
    for tool in args.tools:
        flags[tool], note = preflight(sanitizer, tool, ["--show-backtrace", "no", *TOOL_FLAGS[tool]])
        if note:
            notes.append(note)

    def run_tool(task):
        tool, env, names = task
        quick = tool in QUICK_TOOLS and not args.full
        prefix = [sanitizer, "--tool", tool, "--report-api-errors", "no", "--error-exitcode", str(ERROR_EXIT),
                  "--print-limit", str(args.print_limit), "--log-file", "{log}", *flags[tool]]
        print(f"{tool} [{_group_name(env)}]: {len(names)} cases{' (quick variants)' if quick else ''}", flush=True)
        r = run_worker(names, env, tool, out, f"{tool}-{_group_name(env).replace('=', '-').replace(',', '_')}",
                       args.timeout, quick, prefix)
        r["parsed"] = [parse_log(Path(p).read_text(errors="replace"), fams) for p in r["logs"] if Path(p).exists()]
        r["findings"] = []
        for i, p in enumerate(r["logs"]):
            if Path(p).exists():
                allocs = load_allocations(r["allocs"][i]) if i < len(r["allocs"]) else None
                r["findings"] += findings(Path(p).read_text(errors="replace"), fams, allocs)
        return r

    # tool x environment group: one sanitizer process each (--tool-jobs of them at once)
    tasks = [(tool, env, names) for tool in args.tools for env, names in groups.items()]
    with ThreadPoolExecutor(max(1, args.tool_jobs)) as pool:
        done = list(pool.map(run_tool, tasks))
    for tool in args.tools:
        phase = dict(groups=[], results={}, by_family={}, summary=0, warnings=0, unusable=None, seconds=0.0,
                     findings=[])
        for (t, env, names), r in zip(tasks, done):
            if t != tool:
                continue
            for p in r["parsed"]:
                for fam, n in p["by_family"].items():
                    phase["by_family"][fam] = phase["by_family"].get(fam, 0) + n
                phase["summary"] += p["summary"] or 0
                phase["warnings"] += p["warnings"]
                phase["unusable"] = phase["unusable"] or p["unusable"]
            if not r["parsed"]:
                phase["unusable"] = phase["unusable"] or "no sanitizer log was written"
            phase["results"].update(r["results"])
            phase["findings"] += r["findings"]
            phase["seconds"] = round(phase["seconds"] + r["seconds"], 1)
            phase["groups"].append(dict(env=dict(env), cases=names, logs=r["logs"], returncodes=r["returncodes"],
                                        seconds=r["seconds"], parsed=r["parsed"]))
        phase["findings"].sort(key=lambda f: -f["n"])
        # each case's record gets the findings in its own memory (initcheck: the allocation's case)
        for f in phase["findings"]:
            for v in f["variants"]:
                rec = phase["results"].get(v.split(":")[0])
                if rec is not None:
                    rec.setdefault("findings", []).append({k: f[k] for k in ("n", "what", "kernel", "pc", "site",
                                                                             "bytes", "offsets", "outside")})
        with open(out / f"{tool}.findings.jsonl", "w") as fh:
            for f in phase["findings"]:
                fh.write(json.dumps(f) + "\n")
        log["phases"][tool] = phase

    # verdict, failures, table
    bad = []
    for ph, data in log["phases"].items():
        for name, rec in data["results"].items():
            if not rec.get("ok", False):
                why = rec.get("error") or "; ".join(f"{c['label']}: {c['msg']}" for c in rec.get("checks", [])
                                                    if not c["ok"])[:400]
                bad.append(f"{ph:10s} {name}: {why}")
        if ph != "plain":
            if data["summary"] or sum(data["by_family"].values()):
                bad.append(f"{ph:10s} {data['summary']} errors reported (logs: {out})")
            if data["unusable"]:
                bad.append(f"{ph:10s} sanitizer unusable here: {data['unusable']}")
    log["failures"] = bad
    log["seconds"] = round(time.time() - t_start, 1)
    (out / "sanitize.json").write_text(json.dumps(log, indent=1, default=str))

    families_order = []
    for c in runnable:
        families_order += [f for f in c.families if f not in families_order]
    extra = sorted({f for t in args.tools for f in log["phases"][t]["by_family"]} - set(families_order))
    header = ["family", "cases", "plain"] + list(args.tools)
    rows = []

    def failed(ph, fam):
        return sum(1 for n, rec in log["phases"][ph]["results"].items()
                   if not rec.get("ok", False) and fam in CASES[n].families)
    for fam in families_order + extra:
        cases_n = sum(1 for c in runnable if fam in c.families)
        nf = failed("plain", fam)
        row = [fam, str(cases_n) if cases_n else "-", f"{nf}f" if nf else ("ok" if cases_n else "-")]
        for t in args.tools:
            row.append(_cell(log["phases"][t]["by_family"].get(fam, 0), failed(t, fam)))
        rows.append(row)
    plain_failed = sum(not r.get("ok") for r in plain.values())
    rows.append(["total (tool summary)", str(len(runnable)), f"{plain_failed}f" if plain_failed else "ok"]
                + [str(log["phases"][t]["summary"]) for t in args.tools])
    rows.append(["process seconds", "", str(log["phases"]["plain"]["seconds"])]
                + [str(log["phases"][t]["seconds"]) for t in args.tools])
    for n in notes:
        print("note:", n)
    if bad:
        print("\nFAILURES:")
        for b in bad:
            print("  " + b)
    top = [(t, f) for t in args.tools for f in log["phases"][t]["findings"][:args.top]]
    if top:
        print(f"\nTOP FINDINGS (distinct reports, at most {args.top} per tool; all in <tool>.findings.jsonl): "
              f"tool, count, kernel+pc, what | bytes read of the allocation and who allocated it | first variant")
        for t, f in top:
            print("  " + finding_line(t, f))
    print(f"\n{log['environment'].get('gpu')}, {log['environment'].get('sanitizer')}, {log['environment']['date']}; "
          f"{log['seconds']} s; cells: errors attributed by kernel name, +Nf = cases failed (check, crash, "
          f"timeout); racecheck on the quick variants{' (off: --full)' if args.full else ''}; log {out / 'sanitize.json'}")
    print(table(rows, header))
    tarball = Path(args.tarball) if args.tarball else out.parent / "sanitize_logs.tgz"
    print(f"logs: {pack_logs(out, tarball)}")
    return 1 if bad else 0


def pack_logs(out: Path, tarball: Path) -> str:
    """Every log, result and findings file under ``out`` (not the saved references) in one gzipped
    tarball: the device tool brings back a few files only."""
    import tarfile
    try:
        tarball.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(tarball, "w:gz") as tar:
            for p in sorted(out.rglob("*")):
                if p.is_file() and "refs" not in p.relative_to(out).parts and p.resolve() != tarball.resolve():
                    tar.add(p, arcname=str(Path(out.name) / p.relative_to(out)))
        return f"{tarball} ({tarball.stat().st_size // 1024} KiB)"
    except OSError as e:
        return f"no tarball ({e})"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", default=os.environ.get("OUT", "sanitize_out"), help="folder for logs and sanitize.json")
    p.add_argument("--tools", default=",".join(TOOLS),
                   help=f"comma-separated subset of {','.join(TOOLS)}; empty: the plain run only")
    p.add_argument("--only", default="", help="comma-separated case names (or families); default every case")
    p.add_argument("--full", action="store_true", help="every variant under racecheck too (slow)")
    p.add_argument("--variants", default="",
                   help="comma-separated substrings: only the variants whose label holds one (every tool and the "
                        "plain run; e.g. one slow variant under synccheck)")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--sanitizer", default=None, help="path of compute-sanitizer (default: found on PATH / CUDA)")
    p.add_argument("--timeout", type=float, default=420.0, help="seconds per tool and environment group")
    p.add_argument("--jobs", type=int, default=0, help="parallel processes of the plain run (default: cores / 2, <= 8)")
    p.add_argument("--tool-jobs", type=int, default=1,
                   help="sanitizer processes (tool x environment group) run at once on the GPU (default 1)")
    p.add_argument("--print-limit", type=int, default=20000, help="reports compute-sanitizer prints per process")
    p.add_argument("--top", type=int, default=8, help="distinct findings printed per tool at the end")
    p.add_argument("--tarball", default="",
                   help="gzipped tarball of every log (default: sanitize_logs.tgz beside the --out folder)")
    # worker mode (started by the driver)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--phase", default="plain", help=argparse.SUPPRESS)
    p.add_argument("--cases", default="", help=argparse.SUPPRESS)
    p.add_argument("--refs", default="", help=argparse.SUPPRESS)
    p.add_argument("--results", default="", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--allocs", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.tools = [t for t in args.tools.split(",") if t]
    for t in args.tools:
        if t not in TOOLS:
            p.error(f"--tools: {t!r} is not one of {', '.join(TOOLS)}")
    args.only = [c for c in args.only.split(",") if c]
    if args.variants:   # the workers (subprocesses) read it from the environment
        os.environ[VARIANTS_ENV] = args.variants
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        names = [c for c in args.cases.split(",") if c]
        return worker(names, args.phase, Path(args.refs), Path(args.results), args.quick, args.allocs)
    if args.list:
        rows = [[c.name, ",".join(c.families), ",".join(c.ops), _group_name(c.env),
                 ("needs " + ",".join(missing_requirements(c)) + "; " if missing_requirements(c) else "") + c.note]
                for c in select(args.only)]
        print(table(rows, ["case", "families", "ops", "process", "note"]))
        return 0
    return run_gate(args)


if __name__ == "__main__":
    sys.exit(main())
