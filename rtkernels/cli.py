"""The ``rtk`` command: inspect, report, prebuild, waves, cache.  A thin layer over
:mod:`rtkernels.inspect`, :mod:`rtkernels.arch` and :mod:`rtkernels.cache`.

Examples::

    rtk inspect vector_add --param dtype=float16 --out dump/
    rtk inspect elementwise --param op=silu --diff --param vec_bytes=8
    rtk report attention --sweep head_dim=8:256:8 --sweep dtype=float16,bfloat16 --fail-on-spill
    rtk prebuild attention --sweep head_dim=64,128 --arch sm_80,sm_90
    rtk waves matmul --shape 1793,1793,1793 --param block_m=256 --param block_n=128 --sms 108
    rtk cache info

Exit status: 0 ok; 1 ``--fail-on-spill`` found a spilling config; 2 a config failed to compile
(or, for inspect, was invalid); 64 bad command-line usage.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

EXIT_SPILL, EXIT_ERROR, EXIT_USAGE = 1, 2, 64
DEFAULT_SMS = 132   # H100 SXM / H200: the GPUs rtkernels is tuned on


class UsageError(Exception):
    pass


# ---- argument values --------------------------------------------------------------------
def parse_value(text: str) -> Any:
    """``--param`` values: int, float, bool (true/false), else the string itself."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def parse_params(items: Sequence[str] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items or ():
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise UsageError(f"--param {item!r}: expected NAME=VALUE")
        out[name.strip()] = parse_value(value)
    return out


def parse_sweep(item: str) -> tuple[str, list[Any]]:
    """``NAME=START:STOP[:STEP]`` (inclusive integer range) or ``NAME=V1,V2,...``."""
    name, sep, spec = item.partition("=")
    if not sep or not name.strip() or not spec:
        raise UsageError(f"--sweep {item!r}: expected NAME=START:STOP[:STEP] or NAME=V1,V2,...")
    if ":" in spec:
        parts = spec.split(":")
        try:
            nums = [int(p) for p in parts]
        except ValueError:
            raise UsageError(f"--sweep {item!r}: a range takes integers, START:STOP[:STEP]") from None
        if len(nums) not in (2, 3) or (len(nums) == 3 and nums[2] <= 0):
            raise UsageError(f"--sweep {item!r}: expected START:STOP[:STEP] with a positive STEP")
        start, stop, step = nums[0], nums[1], (nums[2] if len(nums) == 3 else 1)
        values: list[Any] = list(range(start, stop + 1, step))
    else:
        values = [parse_value(v) for v in spec.split(",") if v != ""]
    if not values:
        raise UsageError(f"--sweep {item!r}: no values")
    return name.strip(), values


def parse_shape(text: str) -> list[int]:
    try:
        return [int(v) for v in text.replace("x", ",").split(",") if v]
    except ValueError:
        raise UsageError(f"--shape {text!r}: expected integers like 1793,1793,1793") from None


def _archs(text: str | None) -> list[str | None]:
    return [a.strip() for a in text.split(",") if a.strip()] if text else [None]


# ---- op names -> the family the op runs ---------------------------------------------------
# `rtk report attention` answers "what does rtk.attention run?": on sm_90 that is the Hopper
# family (TMA + wgmma), not the mma.sync kernel the name also denotes.  The switch applies when
# every given parameter is one the op's call decides (dtype, head_dim, ...); tile parameters
# (block_m=...) name a config of the family as written, and `--family NAME` always reports NAME.
def _attention_sm90_runs(params: dict) -> bool:
    from .ops import attention_sm90
    return attention_sm90.ENABLED


def _attention_bwd_sm90_runs(params: dict) -> bool:
    from .ops import attention_bwd_sm90
    return attention_bwd_sm90.picks(int(params.get("head_dim", 64)), bool(params.get("causal", False)))


def _attention_bwd_sm90_family(params: dict) -> str:
    from .ops import attention_bwd_sm90
    return "attention_bwd_sm90_big" if int(params.get("head_dim", 64)) > attention_bwd_sm90.MAX_HEAD_DIM \
        else "attention_bwd_sm90"


def _matmul_sm90_runs(params: dict) -> bool:
    from .ops import matmul
    return matmul.USE_SM90 and params.get("dtype", "bfloat16") in ("float16", "bfloat16")


OP_FAMILIES = {
    # op (= its mma.sync family): (sm_90 family or a function of the parameters naming it, the op's
    # call-level parameters, rule, what runs)
    "attention": ("attention_sm90", ("dtype", "head_dim", "causal"), _attention_sm90_runs,
                  "rtk.attention runs attention_sm90 (TMA + wgmma) on sm_90 for arrays TMA can address "
                  "(contiguous ones, packed-qkv slices)"),
    "attention_backward": (_attention_bwd_sm90_family, ("dtype", "head_dim", "causal", "deterministic"),
                           _attention_bwd_sm90_runs,
                           "rtk.attention_backward runs attention_bwd_sm90 on sm_90 for head_dim <= 128 "
                           "and attention_bwd_sm90_big for 136..256"),
    "matmul": ("matmul_sm90", ("dtype", "a_kmajor", "b_kmajor", "has_bias", "activation"), _matmul_sm90_runs,
               "rtk.matmul runs matmul_sm90 (TMA + wgmma) on sm_90 for float16/bfloat16 (float32 keeps matmul)"),
}


def _is_sm90(arch: str | None) -> bool:
    from .kernel import resolve_arch
    try:
        return resolve_arch(arch).startswith("sm_90")
    except Exception:   # a bad --arch: let the compile report it
        return False


def dispatch(name: str, params: dict, arch: str | None) -> tuple[str, str | None]:
    """(family to report, note) for ``rtk report/inspect NAME``: an op's sm_90 family when the op
    runs it for these parameters on ``arch``, else ``name`` itself (with a note when the switch
    was declined because of tile parameters)."""
    entry = OP_FAMILIES.get(name)
    if entry is None or not _is_sm90(arch):
        return name, None
    family, call_params, runs, what = entry
    if callable(family):
        family = family(params)
    extra = sorted(set(params) - set(call_params))
    if extra:
        return name, (f"{what}; reporting the {name} family as named, because {', '.join(extra)} "
                      f"{'is' if len(extra) == 1 else 'are'} its tile parameter{'s' if len(extra) > 1 else ''} "
                      f"(`rtk report {family}` for the other)")
    if not runs(params):
        return name, None
    return family, f"{what}: reporting {family} (--family {name} for the mma.sync kernel)"


def _family_arg(ns: argparse.Namespace) -> tuple[str, bool]:
    """(name, forced) from the positional name and --family."""
    if ns.family_exact and ns.family and ns.family != ns.family_exact:
        raise UsageError(f"two families given: {ns.family!r} and --family {ns.family_exact!r}")
    if not (ns.family or ns.family_exact):
        raise UsageError("name a family or op (e.g. attention), or pass --family NAME")
    return (ns.family_exact, True) if ns.family_exact else (ns.family, False)


# ---- inspect ----------------------------------------------------------------------------
def _compile(family: str, params: dict, arch: str | None, kernel: str | None):
    import rtkernels as rtk
    return rtk.compile(family, arch=arch, kernel=kernel, **params)


def _dump(k, out: Path, stem: str) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for ext, get, mode in ((".cu", lambda: k.source, "w"), (".cubin", lambda: k.cubin, "wb"),
                           (".sass", lambda: k.sass, "w"), (".ptx", lambda: k.ptx, "w")):
        path = out / f"{stem}{ext}"
        try:
            data = get()
        except Exception as exc:  # PTX is a second compile; a failure there must not hide the rest
            if ext != ".ptx":
                raise
            print(f"rtk: warning: no {path.name}: {type(exc).__name__}: {exc}", file=sys.stderr)
            continue
        if mode == "wb":
            path.write_bytes(data)
        else:
            path.write_text(data)
        written.append(str(path))
    return written


def cmd_inspect(ns: argparse.Namespace, diff_params: dict | None) -> int:
    from . import inspect
    params = parse_params(ns.param)
    name, forced = _family_arg(ns)
    family, note = (name, None) if forced else dispatch(name, {**params, **(diff_params or {})}, ns.arch)
    if note:
        print(f"rtk: note: {note}", file=sys.stderr)
    k = _compile(family, params, ns.arch, ns.kernel)
    rep = inspect.report(k, threads_per_block=ns.threads, smem_dynamic=ns.smem_dynamic)
    files: list[str] = []
    stem = _stem(k)
    if ns.out:
        files += _dump(k, Path(ns.out), stem)
        Path(ns.out, f"{stem}.report.json").write_text(inspect.to_json(rep))
        files.append(str(Path(ns.out, f"{stem}.report.json")))
    if diff_params is None:
        if ns.json:
            print(inspect.to_json(rep))
        else:
            print(inspect.format_summary(rep))
            if files:
                print("files: " + " ".join(files))
        return 0
    kb = _compile(family, {**params, **diff_params}, ns.arch, ns.kernel)
    rep_b = inspect.report(kb, threads_per_block=ns.threads, smem_dynamic=ns.smem_dynamic)
    if ns.out:
        files += _dump(kb, Path(ns.out), stem + "-b")
        Path(ns.out, f"{stem}-b.report.json").write_text(inspect.to_json(rep_b))
        files.append(str(Path(ns.out, f"{stem}-b.report.json")))
    d = inspect.diff(rep, rep_b)
    if ns.json:
        print(inspect.to_json({"a": rep, "b": rep_b, "diff": d}))
    else:
        print("a: " + inspect.format_summary(rep))
        print()
        print("b: " + inspect.format_summary(rep_b))
        print()
        print(inspect.format_diff(d), end="")
        if files:
            print("files: " + " ".join(files))
    return 0


def _stem(k) -> str:
    import re
    return re.sub(r"[^\w.-]", "_", getattr(k, "name", "kernel"))


# ---- report / prebuild ------------------------------------------------------------------
def _run_sweep(ns: argparse.Namespace) -> list[dict]:
    """Every config of the sweep on every --arch, each reported as the family its op runs there
    (see :func:`dispatch`), in sweep order."""
    from . import inspect
    sweeps = dict(parse_sweep(s) for s in (ns.sweep or ()))
    fixed = parse_params(ns.param)
    name, forced = _family_arg(ns)
    reports: list[dict] = []
    notes: list[str] = []
    for a in _archs(ns.arch):
        configs = inspect.grid(sweeps, fixed)
        groups: dict[str, list[int]] = {}
        for i, p in enumerate(configs):
            family, note = (name, None) if forced else dispatch(name, p, a)
            groups.setdefault(family, []).append(i)
            if note and note not in notes:
                notes.append(note)
        done: list = [None] * len(configs)
        for family, idx in groups.items():
            reps = inspect.sweep(family, [configs[i] for i in idx], arch=a, jobs=ns.jobs, kernel=ns.kernel,
                                 threads_per_block=ns.threads, smem_dynamic=ns.smem_dynamic)
            for i, rep in zip(idx, reps):
                done[i] = rep
        reports += done
    for note in notes:
        print(f"rtk: note: {note}", file=sys.stderr)
    return reports


def _exit_status(rows: list[dict], fail_on_spill: bool) -> int:
    if any(r.get("status") == "compile_error" for r in rows):
        return EXIT_ERROR
    if fail_on_spill and any(r.get("spills") for r in rows):
        return EXIT_SPILL
    return 0


def cmd_report(ns: argparse.Namespace) -> int:
    from . import inspect
    reports = _run_sweep(ns)
    rows = inspect.rows_of(reports)
    if ns.json:
        text = inspect.to_json(reports)
    elif ns.csv:
        text = inspect.to_csv(rows)
    else:
        text = inspect.to_markdown(rows, drop_constant=not ns.all_columns)
    if ns.out:
        Path(ns.out).write_text(text)
    else:
        print(text, end="" if text.endswith("\n") else "\n")
    _summary(rows, sys.stderr)
    return _exit_status(rows, ns.fail_on_spill)


def cmd_prebuild(ns: argparse.Namespace) -> int:
    from . import cache
    rows = [dict(r, spills=bool((r.get("resources") or {}).get("spill_stores")
                                or (r.get("resources") or {}).get("spill_loads")))
            for r in _run_sweep(ns)]
    _summary(rows, sys.stdout)
    for r in rows:
        if r.get("status") == "compile_error":
            print(f"  compile error: {r.get('params')}: {r.get('error')}")
        elif r.get("spills"):
            res = r.get("resources") or {}
            print(f"  spills: {r.get('params')}: {res.get('spill_stores')} B stored, {res.get('spill_loads')} B loaded, "
                  f"{res.get('registers')} registers")
    print(f"cache: {cache.root()}")
    return _exit_status(rows, ns.fail_on_spill)


def _summary(rows: list[dict], stream) -> None:
    n = len(rows)
    ok = sum(r.get("status", "ok") == "ok" for r in rows)
    invalid = sum(r.get("status") == "invalid" for r in rows)
    errors = sum(r.get("status") == "compile_error" for r in rows)
    spills = sum(bool(r.get("spills")) for r in rows)
    print(f"{n} configs: {ok} compiled, {invalid} invalid (skipped), {errors} failed to compile, "
          f"{spills} spilling", file=stream)


# ---- waves ------------------------------------------------------------------------------
def _block_params(kind: str, params: dict, need: Sequence[str]) -> dict:
    """Tile sizes from --param, else the defaults of the registered family of that name."""
    out = dict(params)
    missing = [n for n in need if n not in out]
    if missing:
        try:
            from .config import family_config
            cfg = family_config(kind).from_params({k: v for k, v in params.items()})
            for n in missing:
                if hasattr(cfg, n):
                    out[n] = getattr(cfg, n)
        except Exception:
            pass
    missing = [n for n in need if n not in out]
    if missing:
        raise UsageError(f"rtk waves {kind}: pass " + " ".join(f"--param {n}=N" for n in missing))
    return out


def cmd_waves(ns: argparse.Namespace) -> int:
    from . import arch
    params = parse_params(ns.param)
    note = None
    if ns.sms:
        sms = ns.sms
    else:
        from . import device
        if device.has_gpu():
            sms = device.sm_count()
            note = f"SM count {sms} read from {device.device_name()}"
        else:
            sms = DEFAULT_SMS
            note = f"no GPU: assuming {DEFAULT_SMS} SMs (H100/H200); pass --sms N for another part"
    rows = []
    for shape_text in ns.shape:
        shape = parse_shape(shape_text)
        if ns.kind == "matmul":
            if len(shape) not in (2, 3, 4):
                raise UsageError("rtk waves matmul: --shape M,N[,K[,BATCH]]")
            p = _block_params("matmul", params, ("block_m", "block_n"))
            batch = shape[3] if len(shape) == 4 else int(p.get("batch", 1))
            tiles = arch.matmul_tiles(shape[0], shape[1], int(p["block_m"]), int(p["block_n"]), batch=batch,
                                      split_k=int(p.get("split_k", 1)))
            tile = f"{p['block_m']}x{p['block_n']}"
        else:
            if len(shape) < 3:
                raise UsageError("rtk waves attention: --shape BATCH,HEADS,SEQLEN_Q[,SEQLEN_K,HEAD_DIM]")
            p = _block_params("attention", params, ("block_m",))
            tiles = arch.attention_tiles(shape[0], shape[1], shape[2], int(p["block_m"]),
                                         num_splits=int(p.get("num_splits", 1)))
            tile = f"{p['block_m']} query rows"
        s = arch.wave_summary(tiles, sms, ns.blocks_per_sm)
        rows.append({"shape": "x".join(map(str, shape)), "tile": tile, **s})
    if ns.json:
        print(json.dumps({"rows": rows, "note": note}, indent=2))
        return 0
    for r in rows:
        print(f"{ns.kind} {r['shape']} with {r['tile']} tiles: {r['tiles']} tiles on {r['sm_count']} SMs x "
              f"{r['blocks_per_sm']} block(s)/SM = {r['waves']} wave(s); last wave {r['tail_tiles']}/{r['slots']} "
              f"full ({r['tail_efficiency']:.0%}); overall {r['efficiency']:.0%} of slots busy")
    if note:
        print(f"note: {note}")
    return 0


# ---- cache ------------------------------------------------------------------------------
def cmd_cache(ns: argparse.Namespace) -> int:
    from . import cache, inspect
    if ns.action == "info":
        info = cache.info()
        if ns.json:
            print(json.dumps(info, indent=2, default=str))
        else:
            for k, v in info.items():
                if k == "why" or (k == "resolved" and v == info["root"]):
                    continue
                if k == "trusted":   # the verdict and its reason on one line
                    v = f"{'yes' if v else 'NO'}: {info['why']}"
                print(f"{k:16} {v}")
    elif ns.action == "list":
        entries = cache.list_entries()
        if ns.json:
            print(json.dumps(entries, indent=2, default=str))
        else:
            print(inspect.to_markdown(entries, columns=["family", "config", "arch", "output", "nvrtc", "created",
                                                        "bytes", "key"]), end="")
    else:
        n = cache.clear()
        print(f"removed {n} cache entr{'y' if n == 1 else 'ies'} from {cache.root()}")
    return 0


# ---- parser -----------------------------------------------------------------------------
def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("family", nargs="?", help="kernel family or op (e.g. vector_add, attention) or a path to "
                                             "your own .cu.j2 template; an op reports the family it runs on the "
                                             "target arch (rtk report attention on sm_90: attention_sm90)")
    p.add_argument("--family", dest="family_exact", metavar="NAME",
                   help="report exactly this family, whatever the op runs (e.g. --family attention for the "
                        "mma.sync kernel on sm_90)")
    p.add_argument("--param", "-p", action="append", metavar="NAME=VALUE",
                   help="a config parameter (int, float, true/false or string); repeatable")
    p.add_argument("--kernel", help="entry point (default: the family's first / the template's only kernel)")
    p.add_argument("--threads", type=int, help="threads per block (default: the config's threads_per_block)")
    p.add_argument("--smem-dynamic", type=int, help="dynamic shared memory bytes at launch "
                                                   "(default: the config's shared_mem_bytes, else 0)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="rtk", description="Inspect, report on and prebuild rtkernels kernels.")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="dump .cu/.ptx/.cubin/.sass of one config and summarize it",
                       description="Compile one config and print registers, spills, shared memory, "
                                   "occupancy, SASS statistics and flags. `--diff --param K=V ...` compiles a "
                                   "second config (the first with those overrides) and shows what changed.")
    _common(p)
    p.add_argument("--arch", help="target, e.g. sm_90 (default: RTKERNELS_ARCH, the GPU, else sm_90)")
    p.add_argument("--out", help="folder for the .cu, .ptx, .cubin, .sass and report.json")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--diff", action="store_true", help="compare with a second config: the --param after --diff")

    for name, hlp in (("report", "one row per config of a sweep (markdown, --json or --csv)"),
                      ("prebuild", "compile every config of a sweep into the disk cache")):
        p = sub.add_parser(name, help=hlp)
        _common(p)
        p.add_argument("--sweep", "-s", action="append", metavar="NAME=A:B[:S]|V1,V2",
                       help="swept parameter: inclusive integer range or comma list; repeatable")
        p.add_argument("--arch", help="target(s), comma separated: sm_80,sm_90")
        p.add_argument("--jobs", "-j", type=int, default=None, help="worker processes (default: CPU count)")
        p.add_argument("--fail-on-spill", action="store_true", help=f"exit {EXIT_SPILL} if any config spills")
        if name == "report":
            fmt = p.add_mutually_exclusive_group()
            fmt.add_argument("--json", action="store_true")
            fmt.add_argument("--csv", action="store_true")
            p.add_argument("--all-columns", action="store_true", help="keep columns equal in every row")
            p.add_argument("--out", help="write the table to this file instead of stdout")

    p = sub.add_parser("waves", help="tiles, waves and tail efficiency of a problem shape")
    p.add_argument("kind", choices=("matmul", "attention"))
    p.add_argument("--shape", action="append", required=True,
                   help="matmul: M,N[,K[,BATCH]]; attention: BATCH,HEADS,SEQLEN_Q[,...]; repeatable")
    p.add_argument("--param", "-p", action="append", metavar="NAME=VALUE",
                   help="block_m, block_n (matmul), split_k, num_splits")
    p.add_argument("--sms", type=int, help=f"SM count (default: the GPU's, else {DEFAULT_SMS})")
    p.add_argument("--blocks-per-sm", type=int, default=1, help="resident blocks per SM (from occupancy)")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("cache", help="show (root, owner, mode, trusted or not and why), list or clear the disk cache")
    p.add_argument("action", choices=("info", "list", "clear"))
    p.add_argument("--json", action="store_true")
    return ap


def _split_diff(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """``inspect ... --diff --param k=v`` -> (argv with --diff kept, the --param items after it)."""
    if "--diff" not in argv:
        return argv, None
    i = argv.index("--diff")
    head, tail = argv[:i + 1], argv[i + 1:]
    tp = argparse.ArgumentParser(prog="rtk inspect --diff", add_help=False)
    tp.add_argument("--param", "-p", action="append", metavar="NAME=VALUE")
    tns, rest = tp.parse_known_args(tail)
    return head + rest, list(tns.param or [])


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rtk`` console script; returns the exit status."""
    from .errors import CompileError, RtkError
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    try:
        diff_items = None
        if argv and argv[0] == "inspect":
            argv, diff_items = _split_diff(argv)
        ns = ap.parse_args(argv)
        if ns.command == "inspect":
            if ns.diff and not diff_items:
                raise UsageError("--diff needs the second config's changes after it: --diff --param NAME=VALUE")
            return cmd_inspect(ns, parse_params(diff_items) if ns.diff else None)
        if ns.command == "report":
            return cmd_report(ns)
        if ns.command == "prebuild":
            return cmd_prebuild(ns)
        if ns.command == "waves":
            return cmd_waves(ns)
        return cmd_cache(ns)
    except UsageError as exc:
        print(f"rtk: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except CompileError as exc:
        print(f"rtk: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except RtkError as exc:   # ConfigError and friends: the message names what is allowed
        print(f"rtk: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:   # `rtk report ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
