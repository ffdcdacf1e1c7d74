"""NVRTC through cuda.bindings: CUDA C++ -> CUBIN (or PTX on request) + the ptxas report.

The compile always passes ``--ptxas-options=-v`` and ``--no-cache``: NVRTC >= 12.9 keeps
an internal cache that, on a hit, skips ptxas and with it the register/spill report we
store with every entry.  Our own cache (cache.py) sits above this layer.
"""
from __future__ import annotations

import dataclasses
import re
from functools import lru_cache
from typing import Iterable

from .errors import CompileError, ConfigError

_ARCH = re.compile(r"^(sm|compute)_(\d{2,3})([af]?)$")


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    """NVRTC options as data, not loose strings.

    Parameters
    ----------
    std : C++ dialect (``"c++17"``).
    lineinfo : emit line info (for profilers); part of the cache key.
    fast_math : ``--use_fast_math`` (approximate division, sqrt, transcendental functions).
    defines : ``(("NAME", "value"), ...)`` passed as ``-DNAME=value``.
    ptxas_options : extra ptxas flags, e.g. ``("-O3",)``.
    max_registers : ``--maxrregcount``; None leaves it to ptxas and ``__launch_bounds__``.
    extra : anything else NVRTC accepts, verbatim.
    """

    std: str = "c++17"
    lineinfo: bool = False
    fast_math: bool = False
    defines: tuple = ()
    ptxas_options: tuple = ()
    max_registers: int | None = None
    extra: tuple = ()

    def __post_init__(self):
        if self.max_registers is not None and not (16 <= int(self.max_registers) <= 255):
            raise ConfigError.bad_value("CompileOptions", "max_registers", self.max_registers,
                                        "None or an integer in [16, 255]")
        object.__setattr__(self, "defines", tuple(tuple(d) if not isinstance(d, str) else (d, "1")
                                                  for d in self.defines))
        object.__setattr__(self, "ptxas_options", tuple(self.ptxas_options))
        object.__setattr__(self, "extra", tuple(self.extra))

    def nvrtc_args(self, arch: str, output: str) -> list[str]:
        """The option list for NVRTC; ``output`` is ``"cubin"`` or ``"ptx"``."""
        m = parse_arch(arch)
        target = f"{'sm' if output == 'cubin' else 'compute'}_{m[1]}{m[2]}"
        args = [f"--gpu-architecture={target}", f"-std={self.std}", f"-I{include_dir()}",
                f"-I{cuda_include_dir()}", "--device-as-default-execution-space"]
        if output == "cubin":
            args.append("--ptxas-options=-v")
            args += [f"--ptxas-options={o}" for o in self.ptxas_options]
        if self.lineinfo:
            args.append("--generate-line-info")
        if self.fast_math:
            args.append("--use_fast_math")
        if self.max_registers is not None:
            args.append(f"--maxrregcount={int(self.max_registers)}")
        args += [f"-D{k}={v}" for k, v in self.defines]
        args += list(self.extra)
        return args


def include_dir():
    from .render import include_dir as _inc
    return _inc()


@lru_cache(maxsize=None)
def cuda_include_dir() -> str:
    """Where cuda_fp16.h / cuda_bf16.h live (the nvidia-cuda-runtime wheel, or a toolkit)."""
    import cuda.pathfinder as pf
    found = pf.find_nvidia_header_directory("cudart")
    if not found:
        raise CompileError("CUDA runtime headers (cuda_fp16.h) not found: install the "
                           "'nvidia-cuda-runtime' wheel or a CUDA toolkit")
    return str(found)


def parse_arch(arch: str) -> tuple[str, str, str]:
    """'sm_90a' -> ('sm', '90', 'a'); ConfigError for anything else."""
    m = _ARCH.match(str(arch))
    if not m:
        raise ConfigError.bad_value("compile", "arch", arch, "like 'sm_80', 'sm_86', 'sm_89', 'sm_90' or 'sm_90a'")
    return m.group(1), m.group(2), m.group(3)


def _nvrtc():
    from cuda.bindings import nvrtc
    return nvrtc


@lru_cache(maxsize=None)
def nvrtc_version() -> tuple[int, int]:
    err, major, minor = _nvrtc().nvrtcVersion()
    _check(err, "nvrtcVersion")
    return int(major), int(minor)


@lru_cache(maxsize=None)
def supported_archs() -> tuple[int, ...]:
    nv = _nvrtc()
    err, archs = nv.nvrtcGetSupportedArchs()
    _check(err, "nvrtcGetSupportedArchs")
    return tuple(int(a) for a in archs)


def _check(err, what: str) -> None:
    nv = _nvrtc()
    if err != nv.nvrtcResult.NVRTC_SUCCESS:
        _, name = nv.nvrtcGetErrorString(err)
        raise CompileError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")


@dataclasses.dataclass(frozen=True)
class Resources:
    """Per-kernel figures from the ptxas ``-v`` report (bytes unless named otherwise)."""

    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack_frame: int = 0
    shared_static: int = 0
    constant: int = 0
    barriers: int = 0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


_FN = re.compile(r"(?:Compiling entry function|Function properties for) '?([\w$.]+)'?")
_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")


def parse_ptxas_report(log: str) -> dict[str, Resources]:
    """Parse the ``ptxas info`` lines of an NVRTC log into Resources per function."""
    out: dict[str, dict] = {}
    current = None
    for line in log.splitlines():
        m = _FN.search(line)
        if m:
            current = out.setdefault(m.group(1), {})
            continue
        if current is None:
            continue
        m = _STACK.search(line)
        if m:
            current.update(stack_frame=int(m.group(1)), spill_stores=int(m.group(2)),
                           spill_loads=int(m.group(3)))
        m = _USED.search(line)
        if m:
            current["registers"] = int(m.group(1))
            for pat, field in ((r"used (\d+) barriers", "barriers"), (r"(\d+) bytes smem", "shared_static"),
                               (r"(\d+) bytes cmem\[0\]", "constant")):
                mm = re.search(pat, line)
                if mm:
                    current[field] = int(mm.group(1))
    return {name: Resources(**vals) for name, vals in out.items()}


@dataclasses.dataclass(frozen=True)
class CompileResult:
    code: bytes               # CUBIN, or PTX text as bytes
    output: str               # "cubin" | "ptx"
    log: str
    resources: dict           # kernel (lowered) name -> Resources
    lowered_names: dict       # name expression -> lowered (mangled) name


_ERR_LINE = re.compile(r'^(.*?)\((\d+)\): (error|warning|catastrophic error)[^:]*: (.*)$')


def compile_source(rendered, *, name: str, arch: str, options: CompileOptions, output: str = "cubin",
                   name_expressions: Iterable[str] = (), context: str = "") -> CompileResult:
    """Compile rendered source with NVRTC. Raises :class:`CompileError` with located excerpts."""
    nv = _nvrtc()
    _, num, suffix = parse_arch(arch)
    if int(num) not in supported_archs():
        raise ConfigError.bad_value(context or "compile", "arch", arch,
                                    f"an arch this NVRTC {'.'.join(map(str, nvrtc_version()))} supports: "
                                    + ", ".join(f"sm_{a}" for a in supported_archs()))
    src = rendered.compiled_source.encode()
    err, prog = nv.nvrtcCreateProgram(src, f"{name}.cu".encode(), 0, [], [])
    _check(err, "nvrtcCreateProgram")
    try:
        exprs = list(name_expressions)
        for e in exprs:
            _check(nv.nvrtcAddNameExpression(prog, e.encode())[0], f"nvrtcAddNameExpression({e!r})")
        args = options.nvrtc_args(arch, output)
        if nvrtc_version() >= (12, 9):
            args.append("--no-cache")
        opts = [a.encode() for a in args]
        (res,) = nv.nvrtcCompileProgram(prog, len(opts), opts)
        log = _get_log(prog)
        if res != nv.nvrtcResult.NVRTC_SUCCESS:
            _, ename = nv.nvrtcGetErrorString(res)
            raise _compile_error(rendered, log, ename.decode(), name=name, arch=arch, args=args,
                                 context=context)
        if output == "cubin":
            err, size = nv.nvrtcGetCUBINSize(prog)
            _check(err, "nvrtcGetCUBINSize")
            buf = b" " * size
            _check(nv.nvrtcGetCUBIN(prog, buf)[0], "nvrtcGetCUBIN")
        else:
            err, size = nv.nvrtcGetPTXSize(prog)
            _check(err, "nvrtcGetPTXSize")
            buf = b" " * size
            _check(nv.nvrtcGetPTX(prog, buf)[0], "nvrtcGetPTX")
            buf = buf.rstrip(b"\x00")
        lowered = {}
        for e in exprs:
            err, low = nv.nvrtcGetLoweredName(prog, e.encode())
            _check(err, f"nvrtcGetLoweredName({e!r})")
            lowered[e] = low.decode() if isinstance(low, bytes) else low
        return CompileResult(bytes(buf), output, log, parse_ptxas_report(log), lowered)
    finally:
        nv.nvrtcDestroyProgram(prog)


def _get_log(prog) -> str:
    nv = _nvrtc()
    err, size = nv.nvrtcGetProgramLogSize(prog)
    _check(err, "nvrtcGetProgramLogSize")
    buf = b" " * size
    _check(nv.nvrtcGetProgramLog(prog, buf)[0], "nvrtcGetProgramLog")
    return buf.rstrip(b"\x00").decode(errors="replace")


def _compile_error(rendered, log: str, ename: str, *, name: str, arch: str, args: list[str],
                   context: str) -> CompileError:
    # rendered line numbers of each template (file, line), to show the clean source around an error
    where: dict[tuple, int] = {}
    for i, origin in enumerate(rendered.line_map, 1):
        if origin is not None and origin not in where:
            where[origin] = i
    # compiled line number -> clean line number: the clean text omits the #line directives
    clean_no, n = {}, 0
    compiled_lines = rendered.compiled_source.split("\n")
    for i, origin in enumerate(rendered.line_map, 1):
        if origin is not None or not compiled_lines[i - 1].startswith("#line "):
            n += 1
        clean_no[i] = n
    clean_lines = rendered.source.split("\n")
    parts = [f"{context or name}: NVRTC {'.'.join(map(str, nvrtc_version()))} failed to compile for {arch} "
             f"({ename})", f"  options: {' '.join(args)}"]
    for line in log.splitlines():
        m = _ERR_LINE.match(line.strip())
        if not m or m.group(3) == "warning":
            continue
        fname, lno, msg = m.group(1), int(m.group(2)), m.group(4)
        parts.append(f"\n{fname}:{lno}: {m.group(3)}: {msg}")
        at = where.get((fname, lno))
        if at is not None:
            parts.append("  rendered source around it:")
            c = clean_no[at]
            lo, hi = max(1, c - 3), min(len(clean_lines), c + 3)
            for j in range(lo, hi + 1):
                parts.append(f"  {'>' if j == c else ' '} {j:5d} | {clean_lines[j - 1]}")
    parts.append(f"\nfull NVRTC log:\n{log.strip()}")
    # The caller keeps the source where the user can open it (this layer writes no files).
    return CompileError("\n".join(parts), log=log, source=rendered.source)
