"""What a specialized kernel became: SASS statistics, occupancy, flags, reports, sweeps.

Everything here runs without a GPU: it needs the CUBIN (NVRTC), its disassembly (nvdisasm)
and the ptxas report, all of which :class:`rtkernels.Kernel` carries.

Conventions a config may follow so reports need no extra arguments:

* ``threads_per_block`` (property or field): the launch block size.  Failing that the report
  tries ``num_threads``, ``block_size``, then ``num_warps * 32``; ``report(k, threads_per_block=...)``
  overrides all of them.
* ``shared_mem_bytes`` (property): the *dynamic* shared memory the op passes at launch
  (static shared memory comes from ptxas).  ``report(k, smem_dynamic=...)`` overrides it.
* ``expects_tensor_cores`` / ``expected_global_width`` (class attributes): what a healthy
  build's SASS must contain; see :func:`flags`.
"""
from __future__ import annotations

import csv
import io
import itertools
import json
import os
import re
from typing import Any, Iterable, Mapping, Sequence

from . import arch as _arch
from .errors import ConfigError

# ---- SASS statistics --------------------------------------------------------------------
# One instruction line of nvdisasm output:   /*00c0*/   @!P0 LDG.E.128.CONSTANT R8, desc[UR4][R4.64] ;
_INSN = re.compile(r"^\s*/\*[0-9a-fA-F]+\*/\s+(?:\{\s*)?(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Za-z0-9_]+)*)")

GLOBAL_WIDTHS = (8, 16, 32, 64, 128, 256)
_WIDTH_TOKENS = {"U8": 8, "S8": 8, "U16": 16, "S16": 16, "64": 64, "128": 128, "256": 256}
_TENSOR = ("HMMA", "HGMMA", "IMMA", "IGMMA", "QGMMA", "DMMA", "BMMA", "BGMMA")
_TMA = ("UBLKCP", "UTMALDG", "UTMASTG", "UTMAPF", "UTMAREDG", "UBLKRED", "UBLKPF")
_COUNTED = {
    "LDL": "ldl", "STL": "stl", "LDS": "lds", "STS": "sts", "LDSM": "ldsm", "STSM": "stsm",
    "LDGSTS": "ldgsts", "LD": "ld_generic", "ST": "st_generic", "BAR": "bar", "MUFU": "mufu",
    "UBLKCP": "ublkcp", "UTMALDG": "utmaldg", "UTMASTG": "utmastg",
    "HMMA": "hmma", "HGMMA": "hgmma", "IMMA": "imma",
}
_ATOMICS = ("ATOM", "ATOMG", "ATOMS", "RED", "REDG")


def _empty_stats() -> dict[str, int]:
    s = {"instructions": 0, "ldl": 0, "stl": 0, "global_loads": 0, "global_stores": 0}
    for w in GLOBAL_WIDTHS:
        s[f"ldg_{w}"] = 0
    for w in GLOBAL_WIDTHS:
        s[f"stg_{w}"] = 0
    s.update({"ld_generic": 0, "st_generic": 0, "lds": 0, "sts": 0, "ldsm": 0, "stsm": 0, "ldgsts": 0,
              "ublkcp": 0, "utmaldg": 0, "utmastg": 0, "tma": 0, "hmma": 0, "hgmma": 0, "imma": 0,
              "tensor_core": 0, "bar": 0, "mufu": 0, "atomics": 0})
    return s


def _global_width(modifiers: list[str]) -> int:
    # Modifiers are compared whole: cache hints such as ".LTC128B" must not read as 128-bit.
    for m in modifiers:
        if m in _WIDTH_TOKENS:
            return _WIDTH_TOKENS[m]
    return 32


def sass_text(obj: Any) -> str:
    """SASS of a Kernel (``.sass``) or the text itself."""
    return obj if isinstance(obj, str) else obj.sass


def sass_stats(sass: Any, function: str | None = None) -> dict[str, int]:
    """Count the instructions a kernel's performance story is told with.

    Parameters
    ----------
    sass : nvdisasm text, or a :class:`rtkernels.Kernel` (its ``.sass``).
    function : restrict to one function of a multi-function disassembly.

    Returns
    -------
    dict of ints: ``instructions`` (all but NOP), ``ldl``/``stl`` (local memory: spills and
    stack arrays), ``ldg_<bits>``/``stg_<bits>`` for bits in 8, 16, 32, 64, 128, 256 and their
    totals ``global_loads``/``global_stores``, ``ld_generic``/``st_generic`` (generic-address
    LD/ST), ``lds``/``sts``/``ldsm``/``stsm`` (shared), ``ldgsts`` (cp.async), ``ublkcp``/
    ``utmaldg``/``utmastg`` and their total with other TMA ops ``tma``, ``hmma``/``hgmma``/
    ``imma`` and ``tensor_core`` (every MMA kind, incl. IGMMA/QGMMA/DMMA), ``bar``, ``mufu``,
    ``atomics``.

    Instructions predicated on ``@!PT`` (never executed: padding the scheduler inserts) are skipped.
    """
    text = sass_text(sass)
    if function:
        text = _function_section(text, function) or text
    s = _empty_stats()
    for line in text.splitlines():
        m = _INSN.match(line)
        if not m:
            continue
        pred, op, mods = m.group(1), m.group(2), m.group(3)
        if op == "NOP" or (pred and pred.strip() == "@!PT"):
            continue
        s["instructions"] += 1
        modifiers = mods.split(".")[1:] if mods else []
        if op == "LDG":
            s[f"ldg_{_global_width(modifiers)}"] += 1
            s["global_loads"] += 1
        elif op == "STG":
            s[f"stg_{_global_width(modifiers)}"] += 1
            s["global_stores"] += 1
        elif op in _ATOMICS:
            s["atomics"] += 1
        if op in _COUNTED:
            s[_COUNTED[op]] += 1
        if op in _TMA:
            s["tma"] += 1
        if op in _TENSOR:
            s["tensor_core"] += 1
    return s


def _function_section(text: str, name: str) -> str:
    parts = re.split(r"(?m)^//-+ \.text\.", text)
    for part in parts[1:]:
        if part.split(None, 1)[0] == name:
            return part
    return ""


def widest_global(stats: Mapping[str, int], kind: str) -> int | None:
    """Widest global access of ``kind`` ("ldg" or "stg") in bits, None if there is none."""
    widths = [w for w in GLOBAL_WIDTHS if stats.get(f"{kind}_{w}", 0)]
    return max(widths) if widths else None


# ---- flags ------------------------------------------------------------------------------
def flags(kernel_or_stats: Any, resources: Any = None, config: Any = None, *,
          occupancy: _arch.Occupancy | None = None) -> list[str]:
    """Findings a user should see, as sentences; empty when the build looks healthy.

    Call as ``flags(kernel)`` or ``flags(stats, resources, config)`` (config may be None, or
    a config class/instance with ``expects_tensor_cores`` / ``expected_global_width``).

    * any spill (ptxas spill stores/loads);
    * any local memory (a stack frame, or LDL/STL in SASS: runtime-indexed arrays, spills);
    * a family that expects tensor cores whose SASS has no MMA instruction;
    * global loads (or stores) whose widest access is narrower than the family's
      ``expected_global_width``.  The widest, not every, access is compared: vectorized kernels
      keep scalar code for ragged tails and that must not raise a flag.
    * with ``occupancy``: a configuration that cannot launch (0 blocks per SM).
    """
    if isinstance(kernel_or_stats, Mapping):
        stats = kernel_or_stats
    else:
        stats = sass_stats(kernel_or_stats)
        resources = kernel_or_stats.resources if resources is None else resources
        config = getattr(kernel_or_stats, "config", None) if config is None else config
    out: list[str] = []
    spill_st = int(getattr(resources, "spill_stores", 0) or 0)
    spill_ld = int(getattr(resources, "spill_loads", 0) or 0)
    stack = int(getattr(resources, "stack_frame", 0) or 0)
    if spill_st or spill_ld:
        out.append(f"spills: {spill_st} B spill stores, {spill_ld} B spill loads "
                   f"(registers: {getattr(resources, 'registers', '?')})")
    if stack or stats.get("ldl", 0) or stats.get("stl", 0):
        out.append(f"local memory: {stack} B stack frame, {stats.get('ldl', 0)} LDL / {stats.get('stl', 0)} STL "
                   "in SASS (spills or a runtime-indexed local array)")
    if getattr(config, "expects_tensor_cores", False) and not (stats.get("hmma", 0) or stats.get("hgmma", 0)
                                                              or stats.get("tensor_core", 0)):
        out.append(f"no tensor cores: {getattr(config, 'family', 'this family')} expects HMMA/HGMMA "
                   "but the SASS has none")
    want = getattr(config, "expected_global_width", None)
    if want:
        for kind, what in (("ldg", "loads"), ("stg", "stores")):
            widest = widest_global(stats, kind)
            if widest is not None and widest < int(want):
                counts = ", ".join(f"{stats[f'{kind}_{w}']}x {w}-bit" for w in GLOBAL_WIDTHS
                                   if stats.get(f"{kind}_{w}", 0))
                out.append(f"narrow global {what}: widest is {widest}-bit, family intends {want}-bit ({counts})")
    if occupancy is not None and occupancy.blocks_per_sm == 0:
        out.append(f"cannot launch on {occupancy.arch}: 0 blocks per SM (limited by {occupancy.limiter})")
    return out


# ---- reports ----------------------------------------------------------------------------
def threads_per_block_of(config: Any) -> int | None:
    """The config's launch block size by the documented convention, or None."""
    if config is None:
        return None
    for attr in ("threads_per_block", "num_threads", "block_size"):
        v = getattr(config, attr, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    v = getattr(config, "num_warps", None)
    if isinstance(v, int) and not isinstance(v, bool) and v > 0:
        return 32 * v
    return None


def dynamic_smem_of(config: Any) -> int:
    v = getattr(config, "shared_mem_bytes", None) if config is not None else None
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else 0


def _config_info(kernel: Any) -> tuple[str, dict[str, Any], str]:
    cfg = getattr(kernel, "config", None)
    module = getattr(kernel, "module", None)
    if cfg is not None:
        import dataclasses
        params = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
        return cfg.family, params, cfg.key()
    label = getattr(module, "label", "") or "template"
    params = dict(getattr(module, "_params", {}) or {})
    return label, params, getattr(module, "config_repr", "")


def report(kernel: Any, arch: str | None = None, *, threads_per_block: int | None = None,
           smem_dynamic: int | None = None, carveout: int | None = None) -> dict[str, Any]:
    """Everything inspectable about one compiled kernel, as a JSON-ready dict.

    Parameters
    ----------
    kernel : a :class:`rtkernels.Kernel`.
    arch : occupancy target; default the arch the kernel was compiled for.
    threads_per_block, smem_dynamic : launch figures; default from the config (see module doc).
    carveout : shared-memory carveout preference in percent (None: driver default).

    Returns
    -------
    dict with ``family``, ``kernel``, ``params``, ``config``, ``arch``, ``resources``,
    ``threads_per_block``, ``smem_static``, ``smem_dynamic``, ``occupancy`` (None when the block
    size is unknown), ``sass`` (:func:`sass_stats`), ``pdl`` (:attr:`rtkernels.Kernel.pdl`),
    ``compile_s`` (:attr:`rtkernels.Kernel.compile_seconds`) and ``flags``.
    """
    family, params, config_repr = _config_info(kernel)
    cfg = getattr(kernel, "config", None)
    res = kernel.resources
    target = arch or getattr(kernel, "arch", None) or "sm_90"
    tpb = threads_per_block if threads_per_block is not None else threads_per_block_of(cfg)
    dyn = int(smem_dynamic) if smem_dynamic is not None else dynamic_smem_of(cfg)
    occ, note = None, None
    if tpb:
        try:
            occ = _arch.occupancy(target, tpb, res.registers, res.shared_static, dyn,
                                  barriers=getattr(res, "barriers", 0), carveout=carveout)
        except ConfigError as exc:      # an arch without a limits table (e.g. sm_100)
            note = str(exc)
    else:
        note = "block size unknown: pass threads_per_block (the config exposes no threads_per_block)"
    stats = sass_stats(kernel)
    resources = res.as_dict() if hasattr(res, "as_dict") else dict(vars(res))
    return {
        "family": family, "kernel": getattr(kernel, "name", ""), "params": _jsonable(params),
        "config": config_repr, "arch": str(target), "compiled_for": getattr(kernel, "arch", None),
        "resources": resources, "threads_per_block": tpb, "smem_static": res.shared_static,
        "smem_dynamic": dyn, "occupancy": occ.as_dict() if occ else None, "occupancy_note": note,
        "sass": stats,
        # launched with programmatic dependent launch on sm_90+ (its body begins with the wait)
        "pdl": bool(getattr(kernel, "pdl", False)),
        "compile_s": _seconds(getattr(kernel, "compile_seconds", None)),
        "flags": flags(stats, res, cfg if cfg is not None else None, occupancy=occ),
    }


def _seconds(x) -> float | None:
    return None if x is None else round(float(x), 3)


def _jsonable(d: Mapping[str, Any]) -> dict[str, Any]:
    return {k: (v if isinstance(v, (int, float, str, bool, type(None))) else str(v)) for k, v in d.items()}


# Figures compared by diff() and shown in tables, in display order.
ROW_FIGURES = ("registers", "spill_stores", "spill_loads", "stack_frame", "smem_static", "smem_dynamic",
               "threads_per_block", "blocks_per_sm", "warps_per_sm", "occupancy", "limiter")
SASS_COLUMNS = ("instructions", "ldl", "stl", *(f"ldg_{w}" for w in GLOBAL_WIDTHS), *(f"stg_{w}" for w in GLOBAL_WIDTHS),
                "lds", "sts", "ldsm", "ldgsts", "tma", "hmma", "hgmma", "imma", "bar", "mufu")


def flatten(rep: Mapping[str, Any]) -> dict[str, Any]:
    """One flat row (params first) from a :func:`report` dict: what tables and CSV show."""
    row: dict[str, Any] = {"family": rep.get("family"), "kernel": rep.get("kernel")}
    row.update(rep.get("params", {}))
    row["arch"] = rep.get("arch")
    res = rep.get("resources") or {}
    row.update({"registers": res.get("registers"), "spill_stores": res.get("spill_stores"),
                "spill_loads": res.get("spill_loads"), "stack_frame": res.get("stack_frame"),
                "smem_static": rep.get("smem_static"), "smem_dynamic": rep.get("smem_dynamic"),
                "threads_per_block": rep.get("threads_per_block")})
    occ = rep.get("occupancy") or {}
    row.update({"blocks_per_sm": occ.get("blocks_per_sm"), "warps_per_sm": occ.get("warps_per_sm"),
                "occupancy": None if not occ else round(occ["occupancy_fraction"], 4),
                "limiter": occ.get("limiter")})
    stats = rep.get("sass") or {}
    for c in SASS_COLUMNS:
        row[c] = stats.get(c)
    row["compile_s"] = rep.get("compile_s")   # NVRTC seconds of the kernel's module (issue targets: cold compile)
    row["spills"] = bool(res.get("spill_stores") or res.get("spill_loads"))
    row["flags"] = "; ".join(rep.get("flags") or [])
    if rep.get("error"):
        row["error"] = rep["error"]
    return row


def diff(report_a: Mapping[str, Any], report_b: Mapping[str, Any]) -> dict[str, Any]:
    """What changed between two reports.

    Returns
    -------
    dict with ``params`` (name -> (a, b) for parameters that differ), ``changes`` (figure ->
    {"a", "b", "delta"} for every figure or SASS count that differs; delta is None for text)
    and ``flags`` ({"added": [...], "removed": [...]}).
    """
    fa, fb = flatten(report_a), flatten(report_b)
    pa, pb = report_a.get("params", {}), report_b.get("params", {})
    params = {k: (pa.get(k), pb.get(k)) for k in sorted(set(pa) | set(pb)) if pa.get(k) != pb.get(k)}
    changes: dict[str, Any] = {}
    sa, sb = report_a.get("sass") or {}, report_b.get("sass") or {}
    keys = [(k, fa.get(k), fb.get(k)) for k in ROW_FIGURES]
    keys += [(k, sa.get(k), sb.get(k)) for k in sorted(set(sa) | set(sb))]
    for k, a, b in keys:
        if a != b:
            num = isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool)
            changes[k] = {"a": a, "b": b, "delta": (b - a) if num else None}
    fla, flb = report_a.get("flags") or [], report_b.get("flags") or []
    return {"params": params, "changes": changes,
            "flags": {"added": [f for f in flb if f not in fla], "removed": [f for f in fla if f not in flb]}}


# ---- sweeps -----------------------------------------------------------------------------
def grid(sweeps: Mapping[str, Sequence[Any]], fixed: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """Cartesian product of swept values (in the given order), each merged over ``fixed``."""
    names = list(sweeps)
    out = []
    for values in itertools.product(*(list(sweeps[n]) for n in names)):
        p = dict(fixed or {})
        p.update(zip(names, values))
        out.append(p)
    return out


def _sweep_one(family: str, params: dict, arch: str | None, kernel: str | None,
               threads_per_block: int | None, smem_dynamic: int | None) -> dict[str, Any]:
    """Worker: build, compile (landing in the disk cache) and report one config."""
    import rtkernels as rtk
    from .errors import CompileError, ConfigError
    try:
        k = rtk.compile(family, arch=arch, kernel=kernel, **params)
        rep = report(k, threads_per_block=threads_per_block, smem_dynamic=smem_dynamic)
        rep["status"] = "ok"
    except ConfigError as exc:
        rep = {"family": family, "params": _jsonable(params), "arch": arch, "status": "invalid",
               "error": str(exc).splitlines()[0]}
    except CompileError as exc:
        lines = str(exc).splitlines()
        first_error = next((ln.strip() for ln in lines if ": error" in ln), "")
        rep = {"family": family, "params": _jsonable(params), "arch": arch, "status": "compile_error",
               "error": "; ".join(x for x in (lines[0] if lines else "", first_error) if x)}
    return rep


def sweep(family: str, grid_of_params: Mapping[str, Sequence[Any]] | Iterable[Mapping[str, Any]],
          arch: str | None = None, jobs: int | None = None, *, fixed: Mapping[str, Any] | None = None,
          kernel: str | None = None, threads_per_block: int | None = None,
          smem_dynamic: int | None = None) -> list[dict[str, Any]]:
    """Compile and report every config of a sweep, in parallel worker processes.

    Parameters
    ----------
    family : family name or user template path (``rtk.compile``'s first argument).
    grid_of_params : {name: values} (the cartesian product is taken, merged over ``fixed``)
        or an iterable of complete parameter dicts.
    arch : target; default as ``rtk.compile``.
    jobs : worker processes (default: CPU count; 1 runs in this process).  Workers are
        spawned, not forked (forking a process that may hold a CUDA context is unsafe), and
        each compile lands in the shared disk cache, so a sweep doubles as a prebuild.

    Returns
    -------
    One :func:`report` dict per config, in grid order, each with ``status`` ("ok", "invalid" for
    a ConfigError, "compile_error") and ``error`` when not ok.
    """
    if isinstance(grid_of_params, Mapping):
        configs = grid(grid_of_params, fixed)
    else:
        configs = [dict(fixed or {}, **p) for p in grid_of_params]
    jobs = max(1, int(jobs or os.cpu_count() or 1))
    args = [(family, p, arch, kernel, threads_per_block, smem_dynamic) for p in configs]
    if jobs == 1 or len(configs) <= 1:
        return [_sweep_one(*a) for a in args]
    import concurrent.futures as cf
    import multiprocessing as mp
    with cf.ProcessPoolExecutor(max_workers=min(jobs, len(configs)), mp_context=mp.get_context("spawn")) as ex:
        return list(ex.map(_sweep_one, *zip(*args)))


# ---- formatting -------------------------------------------------------------------------
def _mark(row: Mapping[str, Any]) -> str:
    if row.get("error"):
        return "INVALID" if row.get("status") == "invalid" else "ERROR"
    if row.get("spills"):
        return "SPILL"
    if row.get("flags"):
        return "FLAG"
    return ""


def rows_of(reports: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Flat rows (with a leading ``mark``: SPILL / FLAG / INVALID / ERROR) from reports."""
    rows = []
    for rep in reports:
        row = flatten(rep)
        row["status"] = rep.get("status", "ok")
        rows.append({"mark": _mark(row), **row})
    return rows


def _columns(rows: Sequence[Mapping[str, Any]], drop_constant: bool) -> list[str]:
    cols: list[str] = []
    for r in rows:
        for k in r:
            if k not in cols:
                cols.append(k)
    if drop_constant and len(rows) > 1:
        keep = {"mark", "registers", "spill_stores", "blocks_per_sm", "occupancy", "limiter", "flags", "error"}
        cols = [c for c in cols if c in keep or len({json.dumps(r.get(c), default=str) for r in rows}) > 1]
    return cols


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v).replace("|", "\\|").replace("\n", " ")


def to_markdown(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None,
                drop_constant: bool = True) -> str:
    """A GitHub-markdown table; columns equal in every row are dropped unless named."""
    if not rows:
        return "(no rows)\n"
    cols = list(columns) if columns else _columns(rows, drop_constant)
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(f"{r[c]:.0%}" if c == "occupancy" and isinstance(r.get(c), float)
                                       else _cell(r.get(c)) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def to_csv(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> str:
    cols = list(columns) if columns else _columns(rows, drop_constant=False)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({c: ("" if r.get(c) is None else r.get(c)) for c in cols})
    return buf.getvalue()


def to_json(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=str)


def format_summary(rep: Mapping[str, Any]) -> str:
    """Human-readable summary of one report (what ``rtk inspect`` prints)."""
    res = rep["resources"]
    lines = [f"{rep['family']} · {rep['kernel']} · {rep['arch']}" + (f"   [{rep['config']}]" if rep.get("config") else "")]
    lines.append(f"  registers      {res['registers']:>5}   spills {res['spill_stores']} B stores / "
                 f"{res['spill_loads']} B loads   stack frame {res['stack_frame']} B")
    lines.append(f"  shared memory  {rep['smem_static']} B static + {rep['smem_dynamic']} B dynamic   "
                 f"threads/block {rep['threads_per_block'] if rep['threads_per_block'] else '? (pass --threads)'}")
    occ = rep.get("occupancy")
    if occ:
        lim = ", ".join(f"{k} {v}" for k, v in occ["limits"].items() if v is not None)
        lines.append(f"  occupancy      {occ['blocks_per_sm']} blocks/SM, {occ['warps_per_sm']}/"
                     f"{occ['max_warps_per_sm']} warps ({occ['occupancy_fraction']:.0%}), limited by "
                     f"{occ['limiter']}   (blocks allowed by {lim})")
    else:
        lines.append("  occupancy      unknown block size: the config exposes no threads_per_block")
    s = rep["sass"]
    gl = ", ".join(f"{s[f'ldg_{w}']}x{w}" for w in GLOBAL_WIDTHS if s[f"ldg_{w}"]) or "0"
    gs = ", ".join(f"{s[f'stg_{w}']}x{w}" for w in GLOBAL_WIDTHS if s[f"stg_{w}"]) or "0"
    lines.append(f"  SASS           {s['instructions']} instructions; global loads {gl}; stores {gs} (bits)")
    lines.append(f"                 local LDL {s['ldl']} / STL {s['stl']}; shared LDS {s['lds']} / STS {s['sts']} / "
                 f"LDSM {s['ldsm']}; async LDGSTS {s['ldgsts']} / TMA {s['tma']}")
    lines.append(f"                 tensor HMMA {s['hmma']} / HGMMA {s['hgmma']} / IMMA {s['imma']}; "
                 f"BAR {s['bar']}; MUFU {s['mufu']}")
    if rep.get("compile_s") is not None:
        lines.append(f"  NVRTC          {rep['compile_s']:.3f} s (the module's compile, {rep.get('compiled_for')})")
    fl = rep.get("flags") or []
    lines.append("  flags          " + ("none" if not fl else fl[0]))
    lines += ["                 " + f for f in fl[1:]]
    return "\n".join(lines)


def format_diff(d: Mapping[str, Any]) -> str:
    """Markdown of a :func:`diff`."""
    out = []
    if d["params"]:
        out.append("params: " + ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in d["params"].items()))
    if not d["changes"]:
        out.append("no figure changed")
    else:
        out.append("| figure | a | b | delta |")
        out.append("|---|---|---|---|")
        for k, c in d["changes"].items():
            delta = "" if c["delta"] is None else (f"{c['delta']:+.3g}" if isinstance(c["delta"], float)
                                                   else f"{c['delta']:+d}")
            out.append(f"| {k} | {_cell(c['a'])} | {_cell(c['b'])} | {delta} |")
    for f in d["flags"]["added"]:
        out.append(f"+ flag: {f}")
    for f in d["flags"]["removed"]:
        out.append(f"- flag: {f}")
    return "\n".join(out) + "\n"
