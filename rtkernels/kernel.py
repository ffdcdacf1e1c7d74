"""Compiled kernels: build (render -> cache -> NVRTC), inspect, load per device, launch.

``Module`` is one compiled program (CUBIN, source, ptxas report); ``Kernel`` is one entry
point of it.  Launch goes through CuPy's ``cupy.cuda.function.Function`` - the same C path
RawKernel uses - after our own argument packing, which converts each argument to exactly
the type the kernel's signature declares (parsed from the source once, at build time).
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from functools import cached_property
from typing import Any, Sequence

import numpy as np

from . import cache, device
from . import pdl as pdl_mod
from ._version import __version__
from .compiler import CompileOptions, Resources, compile_source, nvrtc_version, parse_arch
from .errors import CompileError, ConfigError, DeviceError, LaunchError
from .render import Rendered, Template, render

_SMEM_DEFAULT_LIMIT = 48 * 1024
_memo: dict = {}
_memo_lock = threading.Lock()
# build_module's keys being built, each with the event its builder sets when done
_building: dict = {}
_building_lock = threading.Lock()


def _clear_memo() -> None:
    with _memo_lock:
        _memo.clear()


cache.on_clear_memory(_clear_memo)   # cache.clear_memory() forgets this layer's memo too


# ---- kernel signatures -----------------------------------------------------------------
_SCALARS = {
    "bool": np.bool_, "char": np.int8, "signed char": np.int8, "int8_t": np.int8, "unsigned char": np.uint8,
    "uint8_t": np.uint8, "short": np.int16, "int16_t": np.int16, "unsigned short": np.uint16,
    "uint16_t": np.uint16, "int": np.int32, "signed": np.int32, "signed int": np.int32, "int32_t": np.int32,
    "unsigned": np.uint32, "unsigned int": np.uint32, "uint32_t": np.uint32, "long": np.int64,
    "long int": np.int64, "long long": np.int64, "long long int": np.int64, "int64_t": np.int64,
    "ptrdiff_t": np.int64, "unsigned long": np.uint64, "unsigned long long": np.uint64,
    "unsigned long long int": np.uint64, "uint64_t": np.uint64, "size_t": np.uint64, "float": np.float32,
    "double": np.float64, "__half": np.float16, "half": np.float16, "__nv_bfloat16": "bfloat16",
}
_QUALIFIERS = {"const", "volatile", "__restrict__", "__restrict", "restrict", "__grid_constant__", "struct"}


@dataclasses.dataclass(frozen=True)
class Param:
    decl: str             # as written, e.g. "const __half* __restrict__ a"
    kind: str             # "pointer" | "scalar" | "struct"
    ctype: str            # "__half*" / "int" / "CUtensorMap"
    np_type: Any = None   # NumPy scalar type for scalars


def _parameter_list(source: str, name: str) -> tuple[int, int] | None:
    """(start, end) of the parameter list of ``__global__ void name(...)`` in ``source``: from
    just past its opening parenthesis to just past its closing one; None if not found."""
    m = re.search(r"__global__\s+(?:__\w+__\s*\([^)]*\)\s*)*void\s+(?:__\w+__\s*\([^)]*\)\s*)*"
                  + re.escape(name) + r"\s*\(", source)
    if not m:
        return None
    depth, i = 1, m.end()
    while depth and i < len(source):
        depth += {"(": 1, ")": -1}.get(source[i], 0)
        i += 1
    return m.end(), i


def parse_signature(source: str, name: str) -> list[Param] | None:
    """Parameters of ``__global__ void name(...)`` in ``source``; None if not found."""
    span = _parameter_list(source, name)
    if span is None:
        return None
    start, i = span
    body = re.sub(r"/\*.*?\*/|//[^\n]*", " ", source[start:i - 1], flags=re.S)
    params, depth, cur = [], 0, ""
    for ch in body:
        if ch in "<([":
            depth += 1
        elif ch in ">)]":
            depth -= 1
        if ch == "," and depth == 0:
            params.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        params.append(cur)
    aliases = {m.group(1): re.sub(r"\s+", " ", m.group(2)).strip()
               for m in re.finditer(r"\busing\s+(\w+)\s*=\s*([\w\s:]+?)\s*;", source)}
    aliases.update({m.group(2): re.sub(r"\s+", " ", m.group(1)).strip()
                    for m in re.finditer(r"\btypedef\s+([\w\s:]+?)\s+(\w+)\s*;", source)})
    out = []
    for decl in (p.strip() for p in params):
        if decl in ("", "void"):
            continue
        decl = re.sub(r"\s+", " ", decl.split("=")[0]).strip()
        if "*" in decl or "&" in decl:
            base = " ".join(t for t in re.split(r"[\s*&]+", decl.rsplit(None, 1)[0]) if t and t not in _QUALIFIERS)
            out.append(Param(decl, "pointer", base + "*"))
            continue
        tokens = [t for t in decl.split(" ") if t not in _QUALIFIERS]
        ctype = " ".join(tokens[:-1]) if len(tokens) > 1 else tokens[0]
        seen = set()
        while ctype in aliases and ctype not in seen:   # using acc_t = float; typedef float real;
            seen.add(ctype)
            ctype = aliases[ctype]
        np_type = _SCALARS.get(ctype)
        out.append(Param(decl, "scalar" if np_type is not None else "struct", ctype, np_type))
    return out


def kernel_names(source: str) -> list[str]:
    """Names of the ``extern "C" __global__`` functions in a source text."""
    return re.findall(r'extern\s+"C"\s+__global__\s+(?:__\w+__\s*\([^)]*\)\s*)*void\s+'
                      r'(?:__\w+__\s*\([^)]*\)\s*)*(\w+)\s*\(', source)


# ---- modules ---------------------------------------------------------------------------
# What the driver reports for each entry function of a loaded CUBIN, beside the ptxas figure the
# module carries: launches decide on the shared-memory opt-in from shared_static, and occupancy
# (resident blocks of persistent grids, the tuner's pruning) comes from registers.  These two
# are what the CUBIN itself records, so a true entry matches them exactly; a stack frame is not
# compared (the driver's local size also counts callees' frames).
_LOAD_CHECKED = (("registers", "CU_FUNC_ATTRIBUTE_NUM_REGS"), ("shared_static", "CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES"))


def resource_mismatch(resources: dict, reported: dict) -> str | None:
    """Why figures read from a cache entry disagree with its loaded code, or None.

    ``resources``: function name -> :class:`Resources` from the entry's meta.json;
    ``reported``: function name -> {field: value} the driver reports for the loaded module.
    """
    for name, attrs in reported.items():
        r = resources.get(name)
        if r is None:
            return f"meta.json has no resources for the function {name}"
        for field, value in attrs.items():
            if getattr(r, field) != value:
                return f"meta.json says {name} has {field}={getattr(r, field)}, the loaded code {value}"
    return None


def _entry_functions(mod) -> list[str] | None:
    """Names of every entry function of a loaded module (driver >= 12.4), else None."""
    try:
        from cuda.bindings import driver as drv
        handle = drv.CUmodule(mod.ptr)
        err, count = drv.cuModuleGetFunctionCount(handle)
        if err != drv.CUresult.CUDA_SUCCESS:
            return None
        err, funcs = drv.cuModuleEnumerateFunctions(count, handle)
        if err != drv.CUresult.CUDA_SUCCESS:
            return None
        names = []
        for f in funcs:
            err, name = drv.cuFuncGetName(f)
            if err != drv.CUresult.CUDA_SUCCESS:
                return None
            names.append(name.decode() if isinstance(name, bytes) else str(name))
        return names
    except Exception:  # noqa: BLE001  (an older driver or binding: fall back to the names we hold)
        return None


def _reported_resources(mod, names) -> dict:
    from cupy_backends.cuda.api import driver as cdrv
    out = {}
    for name in names:
        fn = mod.get_function(name)
        out[name] = {field: int(cdrv.funcGetAttribute(getattr(cdrv, attr), fn.ptr)) for field, attr in _LOAD_CHECKED}
    return out


class Module:
    """One compiled program: code (CUBIN or PTX), rendered source, ptxas report.

    A module read from the disk cache carries figures (resources, lowered names) from its
    meta.json; the first load checks them against what the driver reports for the code, and a
    mismatch discards the entry and compiles afresh (``generation`` then counts up, so kernels
    built on the module refresh what they derived from it).
    """

    def __init__(self, *, label: str, config_repr: str, arch: str, options: CompileOptions, output: str,
                 key: str, parts: dict, rendered: Rendered, template, params: dict, exprs: tuple = ()):
        self.label, self.config_repr, self.arch, self.options = label, config_repr, arch, options
        self.output, self.key, self.source = output, key, rendered.source
        self.code, self.resources, self.log, self.lowered = b"", {}, "", {}
        self.from_disk = False      # figures not yet checked against the loaded code
        self.generation = 0
        # NVRTC seconds of the compile that made the code (from meta.json for a disk entry; None for
        # entries written before it was recorded)
        self.compile_s: float | None = None
        self._parts, self._rendered, self._exprs = parts, rendered, exprs
        self._template, self._params = template, params
        self._loaded: dict[int, Any] = {}
        self._load_lock = threading.Lock()

    @cached_property
    def sass(self) -> str:
        """Disassembly of the whole CUBIN (nvdisasm from the nvidia-cuda-nvdisasm wheel)."""
        if self.output != "cubin":
            raise ConfigError(f"{self.label}: SASS needs a CUBIN; this module holds {self.output}")
        return disassemble(self.code)

    # -- filling
    def _from_entry(self, code: bytes, meta: dict) -> str | None:
        """Take code and figures from a disk entry; returns why the entry is unusable, or None."""
        try:
            resources = {str(n): Resources(**{f: int(v) for f, v in r.items()})
                         for n, r in meta.get("resources", {}).items()}
            lowered = {str(e): str(n) for e, n in meta.get("lowered", {}).items()}
            log = str(meta.get("log", ""))
            compile_s = meta.get("compile_s")
            compile_s = float(compile_s) if compile_s is not None else None
        except (AttributeError, TypeError, ValueError) as exc:
            return f"malformed meta.json ({exc})"
        if set(lowered) != set(self._exprs) or not all(re.fullmatch(r"[\w$]+", n) for n in lowered.values()):
            return "meta.json's lowered names do not match the requested name expressions"
        self.code, self.resources, self.log, self.lowered = code, resources, log, lowered
        self.compile_s = compile_s
        self.from_disk = True
        return None

    def _compile(self) -> None:
        """NVRTC, then write the entry (the caller has the memory level)."""
        name = re.sub(r"\W", "_", self.label) or "kernel"
        t0 = time.perf_counter()
        try:
            res = compile_source(self._rendered, name=name, arch=self.arch, options=self.options, output=self.output,
                                 name_expressions=self._exprs, context=f"{self.label} [{self.config_repr}]")
        except CompileError as exc:
            if exc.source and exc.source_path is None:
                path = cache.save_failed_source(name, exc.source)
                if path:
                    exc.note_source_path(path)
            raise
        self.code, self.resources, self.log, self.lowered = res.code, res.resources, res.log, res.lowered_names
        self.compile_s = time.perf_counter() - t0
        self.from_disk = False
        self.__dict__.pop("sass", None)
        meta = {"family": self.label, "config": self.config_repr, "arch": self.arch, "output": self.output,
                "nvrtc_version": ".".join(map(str, nvrtc_version())), "package_version": __version__,
                "key_parts": {k: v for k, v in self._parts.items() if k != "source"},
                "resources": {n: r.as_dict() for n, r in res.resources.items()}, "log": res.log,
                "lowered": res.lowered_names, "compile_s": round(self.compile_s, 4)}
        cache.disk_put(self.key, res.code, "kernel.cubin" if self.output == "cubin" else "kernel.ptx", meta,
                       self.source)

    # -- loading
    def load(self, dev: int):
        """The CuPy module for device ``dev`` (loaded once per device context)."""
        mod = self._loaded.get(dev)
        if mod is not None:
            return mod
        with self._load_lock:
            if dev in self._loaded:
                return self._loaded[dev]
            if self.output == "ptx":
                drv = device.driver_version()
                if nvrtc_version() > (drv // 1000, (drv % 1000) // 10):
                    raise DeviceError(
                        f"{self.label}: PTX from NVRTC {'.'.join(map(str, nvrtc_version()))} cannot be loaded by "
                        f"this driver (CUDA {drv // 1000}.{(drv % 1000) // 10}): the driver rejects newer PTX "
                        "(CUDA_ERROR_UNSUPPORTED_PTX_VERSION). Load the CUBIN instead (the default output), or "
                        "install an NVRTC no newer than the driver.")
            mod = self._load_code(dev)
            if self.from_disk and self.output == "cubin":
                why = self._check_loaded(mod, dev)
                if why is not None:
                    cache.discard(self.key, why)
                    self._compile()   # if this raises, the next load checks again
                    self.generation += 1
                    mod = self._load_code(dev)
                self.from_disk = False
            self._loaded[dev] = mod
            return mod

    def _load_code(self, dev: int):
        import cupy
        with cupy.cuda.Device(dev):
            mod = cupy.cuda.function.Module()
            try:
                mod.load(self.code)
            except cupy.cuda.driver.CUDADriverError as exc:
                raise LaunchError(f"{self.label}: loading the {self.output} for {self.arch} on device {dev} "
                                  f"({device.device_name(dev)}, {device.device_arch(dev)}) failed: {exc}") from None
        return mod

    def _check_loaded(self, mod, dev: int) -> str | None:
        """Compare the entry's figures with what the driver reports for its code (once per module)."""
        import cupy
        with cupy.cuda.Device(dev):
            names = _entry_functions(mod)
            if names is None:   # no enumeration: every function the figures name that has registers
                names = [n for n, r in self.resources.items() if r.registers] + list(self.lowered.values())
            try:
                reported = _reported_resources(mod, dict.fromkeys(names))
            except cupy.cuda.driver.CUDADriverError as exc:
                return f"the loaded code lacks a function meta.json names ({exc})"
        return resource_mismatch(self.resources, reported)


def disassemble(cubin: bytes) -> str:
    import cuda.pathfinder as pf
    exe = pf.find_nvidia_binary_utility("nvdisasm")
    if not exe:
        raise DeviceError("nvdisasm not found: install the 'nvidia-cuda-nvdisasm' wheel")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([exe, "-c", f.name], capture_output=True, text=True)
    if res.returncode != 0:
        raise DeviceError(f"nvdisasm failed: {res.stderr.strip()}")
    return res.stdout


def function_sass(sass: str, name: str) -> str:
    """The part of a module's SASS that belongs to one function."""
    parts = re.split(r"(?m)^//-+ \.text\.", sass)
    for part in parts[1:]:
        if part.split(None, 1)[0] == name:
            return "//--------------------- .text." + part
    return ""


def build_module(template: str | Template, params: dict, *, label: str, config_repr: str, arch: str,
                 options: CompileOptions, output: str = "cubin", name_expressions: Sequence[str] = ()) -> Module:
    """Render, then return the module from memory, from disk, or from a fresh NVRTC compile."""
    rendered = render(template, params, family=label)
    exprs = tuple(sorted(name_expressions))
    parts = {
        "source": rendered.compiled_source, "arch": arch, "output": output,
        # include folders differ between installs; their contents are hashed separately
        "options": [a for a in options.nvrtc_args(arch, output) if not a.startswith("-I")],
        "name_expressions": list(exprs), "nvrtc": list(nvrtc_version()),
        "headers": cache.headers_digest(), "package": __version__,
    }
    key = cache.make_key(parts)
    while True:
        hit = cache.memory_get(key)
        if hit is not None:
            return hit
        # One build per key at a time: a thread asking for a module another thread is building
        # waits for it (get_kernels compiles a config's modules on threads; a forward may compile
        # its backward ahead) instead of running NVRTC on the same source again.  When the builder
        # failed, or left nothing in memory, the next waiter builds it itself (and meets the error).
        with _building_lock:
            done = _building.get(key)
            if done is None:
                done = _building[key] = threading.Event()
                break
        done.wait()
    try:
        module = Module(label=label, config_repr=config_repr, arch=arch, options=options, output=output, key=key,
                        parts=parts, rendered=rendered, template=template, params=params, exprs=exprs)
        found = cache.disk_get(key)
        if found is not None:
            why = module._from_entry(found[0], found[1])
            if why is not None:
                cache.discard(key, why)
                found = None
        if found is None:
            cache._count("misses")
            module._compile()
        cache.memory_put(key, module)
        return module
    finally:
        with _building_lock:
            if _building.get(key) is done:
                del _building[key]
        done.set()


# ---- kernels ---------------------------------------------------------------------------
class Kernel:
    """One entry point of a compiled module: inspect it, launch it.

    Attributes
    ----------
    name : the entry point (``extern "C"`` name or C++ name expression).
    config : the family config it was built from (None for user templates).
    arch : the target it was compiled for, e.g. ``"sm_90"``.
    """

    def __init__(self, module: Module, name: str, config=None):
        self.module, self.name, self.config = module, name, config
        self.arch = module.arch
        self._generation = module.generation
        self.lowered_name = module.lowered.get(name, name)
        self.signature = parse_signature(module.source, name) if name == self.lowered_name else None
        self._functions: dict[int, Any] = {}
        self._smem_set: dict[int, int] = {}
        self._pack = None   # made with the launcher: the conversions of Kernel.bind
        self._converters = None if self.signature is None else [_converter(self, i, p)
                                                                  for i, p in enumerate(self.signature)]
        if self._converters is not None:
            self.launch = self._make_launcher()

    @cached_property
    def pdl(self) -> bool:
        """Whether this kernel's body begins with ``rtk::grid_dependency_wait()``: launches on
        sm_90+ devices then carry the programmatic-stream-serialization attribute (rtkernels/pdl.py)."""
        span = _parameter_list(self.module.source, self.lowered_name)
        return span is not None and pdl_mod.waits_first(self.module.source, span[1])

    def __repr__(self) -> str:
        r = self.resources
        return (f"<rtkernels.Kernel {self.name} of {self.module.label} [{self.module.config_repr}] for {self.arch}: "
                f"{r.registers} registers, {r.spill_stores}/{r.spill_loads} B spilled, {r.shared_static} B static smem>")

    # -- inspection
    @property
    def resources(self) -> Resources:
        """Registers, spills, stack frame, static shared memory ... from the ptxas report."""
        if self.module.output != "cubin":
            return Resources()
        return self.module.resources.get(self.lowered_name, Resources())

    @property
    def compile_seconds(self) -> float | None:
        """NVRTC seconds (wall clock, this machine's NVRTC) of the compile that produced this kernel's
        module - all its entry points - recorded in the disk entry, so a kernel loaded from the
        cache reports the compile it saved; None for entries written before the figure was kept."""
        return self.module.compile_s

    @property
    def cubin(self) -> bytes:
        if self.module.output != "cubin":
            raise ConfigError(f"{self.module.label}: this kernel was compiled to {self.module.output}, not CUBIN")
        return self.module.code

    @property
    def source(self) -> str:
        """The rendered CUDA source (without the #line directives NVRTC was given)."""
        return self.module.source

    @property
    def sass(self) -> str:
        """SASS of this kernel's function (nvdisasm), disassembled on first access."""
        return function_sass(self.module.sass, self.lowered_name) or self.module.sass

    @cached_property
    def ptx(self) -> str:
        """PTX text, compiled on request (same source, options and arch family)."""
        if self.module.output == "ptx":
            return self.module.code.decode()
        m = build_module(self.module._template, self.module._params, label=self.module.label,
                         config_repr=self.module.config_repr, arch=self.arch, options=self.module.options,
                         output="ptx", name_expressions=self.module._exprs)
        return m.code.decode()

    def report(self, **kw) -> dict:
        """Registers, spills, occupancy, SASS statistics and flags (see rtkernels.inspect)."""
        from . import inspect
        return inspect.report(self, **kw)

    # -- launching
    def function(self, device_id: int | None = None):
        """The loaded ``cupy.cuda.function.Function`` on a device (handle: ``.ptr``)."""
        dev = device.current_device() if device_id is None else device_id
        fn = self._functions.get(dev)
        if fn is None:
            mod = self.module.load(dev)
            if self._generation != self.module.generation:
                self._rebind()
            fn = mod.get_function(self.lowered_name)
            if self.pdl and pdl_mod.device_supports(device._props(dev)["major"]):
                fn = pdl_mod.PdlFunction(fn, dev)
            self._functions[dev] = fn
        return fn

    def _rebind(self) -> None:
        """The module was compiled afresh at load (its cache entry disagreed with its code):
        refresh what this kernel derived from the old figures, the launcher's smem limit included."""
        self._generation = self.module.generation
        self.lowered_name = self.module.lowered.get(self.name, self.name)
        self._functions.clear()
        self._smem_set.clear()
        if self._converters is not None:
            self.launch = self._make_launcher()

    def launch(self, grid, block, *args, shared_mem: int = 0, stream=None) -> None:
        """Launch on CuPy's current stream (or ``stream``: a CuPy stream or anything with ``.ptr``).

        Pointer parameters take CuPy arrays, ``__cuda_array_interface__`` or DLPack objects on the
        current device (or None for a null pointer, or a :class:`DevicePtr`: a raw address the
        caller vouches for); scalars are converted to the declared C type,
        and a wrong count or type is a TypeError before anything is launched.  A grid with a zero
        dimension launches nothing.  ``RTKERNELS_SYNC_LAUNCH=1`` synchronizes after each launch
        and reports asynchronous kernel faults at the launch that caused them.
        """
        # Replaced per instance by a launcher generated for this kernel's signature (see
        # _make_launcher); this body serves kernels whose signature could not be parsed.
        import cupy
        dev = cupy.cuda.runtime.getDevice()
        fn = self._functions.get(dev) or self.function(dev)
        self._launch_checked(fn, dev, _dim3(grid, "grid"), _dim3(block, "block"), tuple(args), shared_mem, stream)

    def _launch_checked(self, fn, dev, grid, block, packed, shared_mem, stream):
        if min(grid) <= 0 or min(block) <= 0:
            return self._empty_grid(grid, block)
        if shared_mem + self.resources.shared_static > _SMEM_DEFAULT_LIMIT:
            self._smem_check(fn, dev, shared_mem)
        if stream is not None and not hasattr(stream, "ptr"):
            stream = _StreamPtr(stream)
        try:
            fn(grid, block, packed, shared_mem, stream)
        except Exception as exc:
            self._launch_failed(exc, grid, block, shared_mem)
        if _SYNC_CHECK:
            self._sync_check(stream)

    def _empty_grid(self, grid, block=(1,)):
        if min(grid) < 0 or min(block) <= 0:
            raise ValueError(f"{self.name}: grid={grid}, block={block}: dimensions must be positive "
                             "(a zero grid dimension launches nothing)")

    def _smem_check(self, fn, dev, shared_mem):
        if self._smem_set.get(dev, 0) < shared_mem:
            self._raise_smem_limit(fn, dev, shared_mem)

    def _launch_failed(self, exc, grid, block, shared_mem):
        import cupy
        if not isinstance(exc, cupy.cuda.driver.CUDADriverError):
            raise exc
        r = self.resources
        raise LaunchError(f"{self.name}: launch failed with grid={grid}, block={block}, shared_mem={shared_mem} "
                          f"({r.registers} registers/thread, {r.shared_static} B static smem): {exc}") from None

    def _sync_check(self, stream):
        import cupy
        try:
            if stream is None:
                cupy.cuda.get_current_stream().synchronize()
            else:
                cupy.cuda.runtime.streamSynchronize(stream.ptr)
        except cupy.cuda.runtime.CUDARuntimeError as exc:
            raise LaunchError(f"{self.name}: kernel failed (RTKERNELS_SYNC_LAUNCH=1): {exc}") from None

    def _make_launcher(self):
        """Generate ``launch`` for this signature: straight-line type checks, no per-call loops.

        CuPy arrays and exactly-typed Python scalars take a fast path of one ``type(x) is``
        test each; anything else goes through the general converter (with its error messages).
        This keeps the per-call cost at CuPy RawKernel's, measured in tools/bench_core.py.
        """
        import cupy
        n = len(self.signature)
        names = _param_names(self.signature)
        multi = device.gpu_count() > 1
        g = {"_ndarray": cupy.ndarray, "_getdev": cupy.cuda.runtime.getDevice, "_fns": self._functions,
             "_kernel": self, "_dim3": _dim3, "_Stream": cupy.cuda.Stream, "_stream_arg": _stream_arg}
        # Parameters are named after the kernel's own, so a wrong count reads e.g.
        # "launch() missing 1 required positional argument: 'n'".
        lines = [f"def launch(grid, block, {''.join(a + ', ' for a in names)}*, shared_mem=0, stream=None):"]
        # The first load may replace the module (a cache entry its code contradicts) and with it
        # this launcher: the first call then hands over to the new one.
        handover = (f"        if _kernel.launch is not launch: return _kernel.launch(grid, block, "
                    f"{''.join(a + ', ' for a in names)}shared_mem=shared_mem, stream=stream)")
        if multi:
            lines += ["    dev = _getdev()",
                      "    fn = _fns.get(dev)",
                      "    if fn is None:",
                      "        fn = _kernel.function(dev)",
                      handover]
        else:   # one device: the loaded function sits in a one-slot list, filled on first launch
            g["_fn"] = [None]
            lines += ["    dev = 0",
                      "    fn = _fn[0]",
                      "    if fn is None:",
                      "        fn = _fn[0] = _kernel.function(0)",
                      handover]
        for i, (p, conv) in enumerate(zip(self.signature, self._converters)):
            g[f"_c{i}"] = conv
            a = names[i]
            if p.kind == "pointer":
                dev_check = f" or {a}.data.device_id != dev" if multi else ""
                lines.append(f"    if type({a}) is not _ndarray{dev_check}: {a} = _c{i}({a}, dev)")
            elif p.kind == "scalar" and p.np_type in (np.int64,):
                lines += _int_arg_lines(a, i, -(1 << 63), (1 << 63) - 1, g)   # CuPy passes a Python int as int64
            elif p.kind == "scalar" and p.np_type is np.float64:
                lines.append(f"    if type({a}) is not float: {a} = _c{i}({a}, dev)")
            elif p.kind == "scalar" and isinstance(p.np_type, type) and issubclass(p.np_type, np.number):
                g[f"_t{i}"] = p.np_type
                kind = "int" if issubclass(p.np_type, np.integer) else "float"
                if kind == "int" and _LITTLE_ENDIAN and np.dtype(p.np_type).itemsize <= 8:
                    # CuPy passes a Python int as 8 bytes and the driver copies the parameter's own
                    # size from it: on a little-endian host the low bytes are the value, so an
                    # in-range int needs no NumPy scalar (saves ~0.2 us per scalar per launch).
                    info = np.iinfo(p.np_type)
                    lines += _int_arg_lines(a, i, int(info.min), int(info.max), g)
                elif kind == "int":
                    info = np.iinfo(p.np_type)
                    lines.append(f"    {a} = _t{i}({a}) if type({a}) is int and {info.min} <= {a} <= {info.max} "
                                 f"else _c{i}({a}, dev)")
                else:
                    lines.append(f"    {a} = _t{i}({a}) if type({a}) is float else _c{i}({a}, dev)")
            else:
                lines.append(f"    {a} = _c{i}({a}, dev)")
        # CuPy's Function pads 1- and 2-tuples and clamps dimensions to >= 1, so a zero or negative
        # dimension must be caught here: zero launches nothing, negative is an error.
        # The last validated (grid, block) pair is remembered by identity: tuples are immutable, and a
        # launch loop usually passes the same objects, so the checks run once.
        # One slot holds (grid, block, linear size, block size), replaced as a whole so threads never
        # see a mixed pair.  A 1-D grid of 1-D blocks launches through Function.linear_launch with
        # size = grid * block and block_max_size = block (the same dimensions): it skips the tuple
        # padding and six clamps Function.__call__ does on Python objects every call.
        g["_seen"] = [(None, None, 0, 0)]
        g["_linear"] = _linear_size
        lines += ["    s = _seen[0]",
                  "    if grid is not s[0] or block is not s[1]:",
                  "        if type(grid) is not tuple or len(grid) > 3: grid = _dim3(grid, 'grid')",
                  "        if type(block) is not tuple or len(block) > 3: block = _dim3(block, 'block')",
                  "        if min(grid) <= 0 or min(block) <= 0: return _kernel._empty_grid(grid, block)",
                  "        s = _seen[0] = (grid, block, _linear(grid, block), block[0])",
                  # The 48 KiB default covers static plus dynamic shared memory together.
                  f"    if shared_mem > {_SMEM_DEFAULT_LIMIT - self.resources.shared_static}: "
                  "_kernel._smem_check(fn, dev, shared_mem)",
                  # CuPy's Function reads stream.ptr: a CuPy stream passes as it is; raw handles
                  # (the ops' torch path) map to cached holders instead of a new object per call
                  "    if stream is not None and type(stream) is not _Stream: stream = _stream_arg(stream)",
                  "    try:",
                  "        if s[2]:",
                  f"            fn.linear_launch(s[2], ({', '.join(names)}{',' if n == 1 else ''}), shared_mem, s[3], stream)",
                  "        else:",
                  f"            fn(grid, block, ({', '.join(names)}{',' if n == 1 else ''}), shared_mem, stream)",
                  "    except Exception as exc:",
                  "        _kernel._launch_failed(exc, grid, block, shared_mem)"]
        if _SYNC_CHECK:
            lines.append("    _kernel._sync_check(stream)")
        # pack: the same lookups, conversions and checks, returning what the launch would hand
        # CuPy instead of launching (Kernel.bind); arrays become bare addresses, so what is kept
        # of a conversion keeps no array alive
        g["_hold"], g["_unowned"] = _pointer_arg(), _unowned
        body = lines[1:lines.index("    s = _seen[0]")]
        pack = [lines[0].replace("def launch(", "def pack(", 1).replace(", stream=None):", "):")]
        for line in body:
            if line == handover:
                line = handover.replace("_kernel.launch is not launch: return _kernel.launch(",
                                        "_kernel._pack is not pack: return _kernel._pack(").replace(
                                        ", stream=stream)", ")")
            m = re.fullmatch(r"    if type\((\w+)\) is not _ndarray(.*): \1 = (_c\d+)\(\1, dev\)", line)
            if m:   # a pointer: check as launch does, then keep only the address
                a = m.group(1)
                line = f"    {a} = _unowned({a} if type({a}) is _ndarray{m.group(2) and ' and not (' + m.group(2)[4:] + ')'} " \
                       f"else {m.group(3)}({a}, dev), _hold)"
            pack.append(line)
        pack += ["    if type(grid) is not tuple or len(grid) > 3: grid = _dim3(grid, 'grid')",
                 "    if type(block) is not tuple or len(block) > 3: block = _dim3(block, 'block')",
                 "    if min(grid) <= 0 or min(block) <= 0:",
                 "        _kernel._empty_grid(grid, block)",
                 "        return None",
                 f"    if shared_mem > {_SMEM_DEFAULT_LIMIT - self.resources.shared_static}: "
                 "_kernel._smem_check(fn, dev, shared_mem)",
                 f"    return fn, grid, block, _linear(grid, block), ({', '.join(names)}{',' if n == 1 else ''})"]
        exec("\n".join(pack), g)   # noqa: S102 - as above
        self._pack = g["pack"]
        exec("\n".join(lines), g)   # noqa: S102 - code built above from the parsed signature only
        launcher = g["launch"]
        launcher.__doc__ = Kernel.launch.__doc__
        return launcher

    def bind(self, grid, block, *args, shared_mem: int = 0, free: int = 0) -> "BoundLaunch":
        """This launch with its grid, block, shared memory and all but the first ``free``
        arguments converted and checked once, for loops that repeat it on other arrays.

        ``args`` are a whole argument list as :meth:`launch` takes it (the first ``free`` ones a
        sample, checked and then dropped).  The :class:`BoundLaunch` launches with the first
        ``free`` arguments given per call, already converted (:meth:`BoundLaunch.convert`, or a
        pointer holder of a raw address): no per-call conversion, checks or keyword handling.
        It runs on the device current here.
        """
        if self._converters is None:   # an unparsed signature: launch() converts every time
            return BoundLaunch(self, None, grid, block, 0, args[free:], shared_mem, free, args[free:])
        from .tma import LAUNCH_ARGS
        keep = tuple(LAUNCH_ARGS.get(id(a), a) for a in args[free:] if isinstance(a, np.void))   # see convert
        packed = self._pack(grid, block, *args, shared_mem=shared_mem)
        if packed is None:   # a zero grid dimension launches nothing
            return BoundLaunch(self, None, grid, block, 0, (), shared_mem, free, None)
        fn, grid, block, linear, packed = packed
        return BoundLaunch(self, fn, grid, block, linear, packed[free:], shared_mem, free, args[free:], keep)

    def launch_cooperative(self, grid, block, *args, shared_mem: int = 0, stream=None) -> None:
        """:meth:`launch` as a cooperative grid (cuLaunchCooperativeKernel): every block is resident
        at once, so blocks may wait for one another (a grid-wide barrier).

        A device without cooperative launches, or a grid larger than the blocks the device holds
        at once (cuOccupancyMaxActiveBlocksPerMultiprocessor x SMs), is a :class:`LaunchError`
        before anything is launched - CuPy would shrink a 1-D grid with a warning, which a kernel
        that sized its work by the grid it asked for must not meet; the driver refuses anything
        else it cannot co-schedule (a cluster shape, say).  Callers catch the error and fall back
        to a launch whose blocks never wait.  Arguments, stream and ``RTKERNELS_SYNC_LAUNCH`` as
        :meth:`launch`; the stream may be capturing (cooperative kernels become graph nodes)."""
        if self._converters is None:
            raise LaunchError(f"{self.name}: a cooperative launch needs the kernel's parsed signature")
        packed = self._pack(grid, block, *args, shared_mem=shared_mem)
        if packed is None:   # a zero grid dimension launches nothing
            return
        fn, grid, block, _, packed = packed
        import cupy
        dev = cupy.cuda.runtime.getDevice()
        limit = self.cooperative_limit(math.prod(block), shared_mem, dev, fn)
        blocks = math.prod(grid)   # (1- and 2-tuples pass as they are; CuPy pads them)
        if blocks > limit:
            raise LaunchError(f"{self.name}: a cooperative grid of {blocks} blocks (block={block}, shared_mem="
                              f"{shared_mem}) exceeds the {limit} this device runs at once"
                              + ("" if limit else " (no cooperative launches on this device)"))
        if stream is not None and type(stream) is not cupy.cuda.Stream:
            stream = _stream_arg(stream)
        try:
            fn(grid, block, packed, shared_mem, stream, enable_cooperative_groups=True)
        except Exception as exc:
            self._launch_failed(exc, grid, block, shared_mem)
        if _SYNC_CHECK:
            self._sync_check(stream)

    def cooperative_limit(self, threads: int, shared_mem: int = 0, dev: int | None = None, fn=None) -> int:
        """The most blocks of ``threads`` threads with ``shared_mem`` bytes of dynamic shared memory
        a cooperative launch of this kernel may have on device ``dev`` (the driver's count,
        cuOccupancyMaxActiveBlocksPerMultiprocessor x SMs, which CuPy checks a cooperative grid
        against), or 0 where the device has no cooperative launches; memoized.

        Beyond the 48 KiB default the function's dynamic shared memory limit is raised first, as a
        launch does: the driver counts a block that asks for more than the function allows as one
        that never fits (0 per SM), so a grid sized before the first launch (bulk_rows' 64 KiB of
        stages, 2026-11-26 on an H200) was refused although every block was resident."""
        if dev is None:
            dev = device.current_device()
        if fn is None:
            fn = self.function(dev)
        if shared_mem + self.resources.shared_static > _SMEM_DEFAULT_LIMIT:
            self._smem_check(fn, dev, shared_mem)   # (a LaunchError where the device has too little)
        return _cooperative_limit(fn, dev, threads, shared_mem)

    def _raise_smem_limit(self, fn, dev: int, nbytes: int) -> None:
        from cupy_backends.cuda.api import driver as cdrv
        limit = device.max_shared_per_block_optin(dev)
        if nbytes + self.resources.shared_static > limit:
            raise LaunchError(f"{self.name}: shared_mem={nbytes} B (+{self.resources.shared_static} B static) exceeds "
                              f"the device's {limit} B per block")
        cdrv.funcSetAttribute(fn.ptr, cdrv.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)
        self._smem_set[dev] = nbytes


_SYNC_CHECK = os.environ.get("RTKERNELS_SYNC_LAUNCH", "0") == "1"
_COOPERATIVE: dict = {}   # (function handle, device, threads, dynamic smem) -> blocks resident at once


def _cooperative_limit(fn, dev: int, threads: int, shared_mem: int) -> int:
    """The most blocks of ``fn`` a cooperative launch may have on ``dev`` (the driver's count, as
    CuPy checks it), or 0 where the device has no cooperative launches; memoized.  Callers go
    through :meth:`Kernel.cooperative_limit`, which raises the function's shared memory limit first."""
    key = (fn.ptr, dev, threads, shared_mem)
    got = _COOPERATIVE.get(key)
    if got is None:
        import cupy
        got = 0
        if device._props(dev).get("cooperativeLaunch", 1):   # (the driver refuses where it lacks them)
            try:   # CuPy's cooperative launch asks the same (an error there would fail the launch)
                per_sm = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.ptr, threads, shared_mem)
                got = int(per_sm) * device.sm_count(dev)
            except cupy.cuda.driver.CUDADriverError:
                got = 0
        _COOPERATIVE[key] = got
    return got


class BoundLaunch:
    """A launch bound by :meth:`Kernel.bind`: ``run(head, stream)`` launches with the converted
    leading arguments ``head`` (a tuple) followed by the bound ones.  What the launcher would do
    per call after its checks, and nothing else."""
    __slots__ = ("kernel", "fn", "grid", "block", "linear", "tail", "shared_mem", "free", "raw_tail", "parsed",
                 "keep", "_stream_type", "_owners")

    def __init__(self, kernel, fn, grid, block, linear, tail, shared_mem, free, raw_tail, keep=()):
        import cupy
        self.kernel, self.fn, self.grid, self.block, self.linear = kernel, fn, grid, block, linear
        self.parsed = kernel._converters is not None   # else heads are raw arguments for launch()
        self.tail, self._owners = _held(tail) if self.parsed and fn is not None else (tuple(tail), ())
        self.shared_mem, self.free, self.raw_tail = shared_mem, free, raw_tail
        self.keep = keep   # the bound tensor maps' launch bytes (see convert)
        self._stream_type = cupy.cuda.Stream

    def convert(self, head) -> tuple:
        """``(converted, keep)``: ``head`` (arrays, tensor maps ... as :meth:`Kernel.launch` takes
        them) converted for :meth:`run` - arrays become bare addresses, memoized tensor maps the
        CuPy pointers to their bytes - and what must stay referenced while ``converted`` is used
        (the tensor maps with their launch bytes; never an array, so a kept conversion holds no
        device memory)."""
        from .tma import LAUNCH_ARGS
        # looked up before the conversion: a memoized map's entry owns the bytes its pointer reads
        keep = tuple(LAUNCH_ARGS.get(id(a), a) for a in head if isinstance(a, np.void))
        if not self.parsed or self.fn is None:
            return tuple(head), keep
        packed = self.kernel._pack(self.grid, self.block, *head, *self.raw_tail, shared_mem=self.shared_mem)
        return packed[4][:self.free], keep

    def run(self, head: tuple, stream=None) -> None:
        fn = self.fn
        if fn is None:
            if self.parsed:
                return None   # an empty grid
            return self.kernel.launch(self.grid, self.block, *head, *self.tail, shared_mem=self.shared_mem,
                                      stream=stream)
        if stream is not None and type(stream) is not self._stream_type:
            stream = _stream_arg(stream)
        try:
            if self.linear:
                fn.linear_launch(self.linear, head + self.tail, self.shared_mem, self.block[0], stream)
            else:
                fn(self.grid, self.block, head + self.tail, self.shared_mem, stream)
        except Exception as exc:
            self.kernel._launch_failed(exc, self.grid, self.block, self.shared_mem)
        if _SYNC_CHECK:
            self.kernel._sync_check(stream)


_HELD: list = []   # (CNumpyArray, a null CPointer) of this CuPy, looked up once


def _held(args) -> tuple:
    """``(arguments, owners)``: converted launch arguments as CuPy's launch takes them without
    converting again, and the arrays their holders point into (kept with them).

    CuPy turns every argument that is not a ``CPointer`` into a new holder on each launch: a
    Python int goes through ``numpy.int64`` (~0.5 us per argument on the development CPU,
    2026-11-26, ``tools/host_model.py --cupy-args``), None, NumPy scalars and records ~0.2 us.
    A bound launch repeats the same scalars, so they are converted here once into the bytes CuPy
    itself would pass (an int as int64, a float as float64, a NumPy scalar as its own type),
    each in a 0-d array of its own behind a ``CNumpyArray`` (which points at the array's data; a
    holder made from a bare scalar would point at a temporary), and None as CuPy passes it, a
    ``CIntptr(0)``.  Arrays, pointer holders and anything else stay as they are."""
    if not _HELD:
        try:
            from cupy.cuda.function import CIntptr, CNumpyArray
            # None as CuPy's own launch passes it: a holder of the value 0.  (A bare CPointer()
            # has a NULL ptr: the driver then gets a NULL kernelParams entry and refuses the
            # launch with CUDA_ERROR_INVALID_VALUE - the attention replays on the H100, 2026-11-25.)
            _HELD.append((CNumpyArray, CIntptr(0)))
        except ImportError:   # an older CuPy: CuPy converts per launch, as before
            _HELD.append(None)
    if _HELD[0] is None:
        return tuple(args), ()
    numpy_arg, null = _HELD[0]   # null: one shared holder of 0 (read-only to every launch)
    out, owners = [], []
    for a in args:
        if a is None:
            a = null
        elif type(a) in (int, float) or isinstance(a, np.number) or type(a) is np.bool_:
            try:
                arr = np.array(a)   # int -> int64, float -> float64, NumPy scalars keep their type
            except OverflowError:   # left to CuPy's launch (and its error)
                arr = None
            if arr is not None and arr.dtype.kind in "biuf" and arr.ndim == 0:
                owners.append(arr)
                a = numpy_arg(arr)
        out.append(a)
    return tuple(out), tuple(owners)


def _unowned(a, holder):
    """A converted pointer argument without a reference to its array: CuPy arrays (and memory
    pointers) by their address; None, addresses and holders as they are."""
    import cupy
    if isinstance(a, cupy.ndarray):
        return holder(a.data.ptr)
    if isinstance(a, cupy.cuda.MemoryPointer):
        return holder(a.ptr)
    return a


_LITTLE_ENDIAN = sys.byteorder == "little"


class DevicePtr(int):
    """A raw device address for a pointer parameter of :meth:`Kernel.launch`; the caller vouches
    that it points at live memory on the launch's device (plain ints stay a TypeError: a wrong
    one would fault the context).  Ops pass torch tensors' ``data_ptr()`` this way on their
    replay paths: a CuPy view or MemoryPointer per tensor costs 2-10 us of host time."""
    __slots__ = ()


class _StreamPtr:
    __slots__ = ("ptr",)

    def __init__(self, s):
        ptr = getattr(s, "cuda_stream", None)  # torch.cuda.Stream
        if ptr is None:
            if isinstance(s, int):
                ptr = s
            else:
                raise TypeError(f"stream must be a CuPy stream, a torch.cuda.Stream or an object with .ptr; "
                                f"got {type(s).__name__}")
        self.ptr = int(ptr)


_STREAM_ARGS: dict = {}


def _stream_arg(stream):
    """What CuPy's Function takes as a stream (anything with ``.ptr``): objects with ``.ptr`` as
    they are, raw handles through a small cache of holders, torch streams by their handle."""
    if type(stream) is int:
        held = _STREAM_ARGS.get(stream)
        if held is None:
            if len(_STREAM_ARGS) > 256:
                _STREAM_ARGS.clear()
            held = _STREAM_ARGS[stream] = _StreamPtr(stream)
        return held
    return stream if hasattr(stream, "ptr") else _StreamPtr(stream)


def _linear_size(grid: tuple, block: tuple) -> int:
    """grid[0] * block[0] for a 1-D grid of 1-D blocks (Function.linear_launch's size), else 0.
    A grid beyond CUDA's 2^31 - 1 blocks is left to Function.__call__, whose launch reports it
    (linear_launch would clamp it)."""
    if any(x != 1 for x in grid[1:]) or any(x != 1 for x in block[1:]) or grid[0] > 0x7FFFFFFF:
        return 0
    return grid[0] * block[0] if LINEAR_LAUNCH else 0


LINEAR_LAUNCH = True   # False: every launch through Function.__call__ (tools/bench_host.py compares)


def _param_names(signature: list[Param]) -> list[str]:
    """Python-safe launcher parameter names taken from the C declarations."""
    import keyword
    taken = {"grid", "block", "shared_mem", "stream", "dev", "fn", "exc", "s"}
    out = []
    for i, p in enumerate(signature):
        m = re.search(r"(\w+)\s*(?:\[\s*\])?$", p.decl)
        name = m.group(1) if m else ""
        if not name.isidentifier() or keyword.iskeyword(name) or name.startswith("_") or name in taken \
                or name in out or name in _SCALARS or name in _QUALIFIERS:
            name = f"arg{i}"
        out.append(name)
    return out


def _dim3(v, what: str) -> tuple:
    if isinstance(v, (int, np.integer)):
        v = (int(v),)
    try:
        t = tuple(int(x) for x in v)
    except TypeError:
        raise TypeError(f"{what} must be an int or a tuple of up to 3 ints, got {v!r}") from None
    if not 1 <= len(t) <= 3 or any(x < 0 for x in t):
        raise ValueError(f"{what} must be 1 to 3 non-negative ints, got {v!r}")
    return t + (1,) * (3 - len(t))


def _bf16_bits(x: float) -> np.uint16:
    b = int(np.array(x, dtype=np.float32).view(np.uint32))
    b += 0x7FFF + ((b >> 16) & 1)   # round to nearest even
    return np.uint16((b >> 16) & 0xFFFF)


def _pointer_arg():
    """CuPy's by-value pointer holder: CuPy passes a ``CPointer`` to the driver as it is, which is
    the cheapest argument it takes (an int becomes a NumPy scalar first, a MemoryPointer a new
    holder).  Older CuPy without ``CIntptr``: a uint64 NumPy scalar (8 bytes, the same value)."""
    from cupy.cuda import function
    return getattr(function, "CIntptr", np.uint64)


_INT_ARGS: dict = {}   # int -> CuPy pointer holder of its int64 bytes, shared by every launcher
_INT_HOLDER: list = []


def _int_arg(v: int):
    """A CuPy pointer holder (``CIntptr``) of ``v``'s int64 bytes, kept per value.  CuPy passes a
    pointer holder as it is, while a Python int becomes a new scalar holder in each launch (~1.9k
    instructions per int against ~0.3k for this lookup, development CPU, 2026-11-26); a launch
    loop passes the same sizes call after call.  Holders are read-only, so one serves every
    launch and thread."""
    if len(_INT_ARGS) >= 4096:
        _INT_ARGS.clear()
    held = _INT_ARGS[v] = _INT_HOLDER[0](v)
    return held


def _int_arg_lines(a: str, i: int, lo: int, hi: int, g: dict) -> list[str]:
    """Launcher lines for an integer parameter of range [lo, hi] taken as CuPy takes a Python int
    (8 little-endian bytes, of which the driver copies the parameter's size): an exactly-typed
    int in range through :func:`_int_arg`'s holders, anything else through the converter."""
    if not _INT_HOLDER:
        _INT_HOLDER.append(_pointer_arg())
    hi = min(hi, (1 << 63) - 1)   # (CIntptr holds an int64; larger uint64 values take the converter)
    if _INT_HOLDER[0] is np.uint64:   # an older CuPy without CIntptr: pass the int, CuPy converts it
        return [f"    if type({a}) is not int or not {lo} <= {a} <= {hi}: {a} = _c{i}({a}, dev)"]
    g["_ints"], g["_int_arg"] = _INT_ARGS, _int_arg
    return [f"    if type({a}) is int and {lo} <= {a} <= {hi}: {a} = _ints.get({a}) or _int_arg({a})",
            f"    else: {a} = _c{i}({a}, dev)"]


def _converter(kernel: Kernel, index: int, p: Param):
    where = f"{kernel.name}() argument {index} ({p.decl})"
    if p.kind == "pointer":
        holder = _pointer_arg()

        def conv(a, dev):
            if a is None:
                return None
            if type(a) is DevicePtr:
                return int(a)
            if getattr(a, "is_cuda", None) is True and hasattr(a, "data_ptr"):
                # a CUDA torch tensor: its address, checked against the launch's device (the ops'
                # launch plans pass tensors as they are; building a CuPy view or MemoryPointer per
                # call cost 2-4 us of host time per tensor)
                owner = a.get_device()
                if owner != dev:
                    raise LaunchError(f"{where}: tensor is on device {owner}, but the launch is on device {dev}")
                return holder(a.data_ptr())
            dev_of = getattr(getattr(a, "data", None), "device_id", None)  # CuPy ndarray (subclasses)
            if dev_of is not None:
                if dev_of != dev:
                    raise LaunchError(f"{where}: array is on device {dev_of}, but the launch is on device {dev}")
                return a
            return _foreign_pointer(a, dev, where)
        return conv
    if p.kind == "struct":
        want = 128 if p.ctype.split("::")[-1] in ("TensorMap", "CUtensorMap") else None
        from .tma import LAUNCH_ARGS as maps

        def conv(a, dev):
            if want is not None:
                hit = maps.get(id(a))
                if hit is not None and hit[0] is a:
                    return hit[1]   # a memoized tensor map: its bytes behind a CuPy CPointer
            if isinstance(a, (np.generic, np.ndarray)) and a.dtype.itemsize > 0:
                if want is not None and a.nbytes != want:
                    raise TypeError(f"{where}: a tensor map is {want} bytes (rtkernels.tma.tensor_map builds "
                                    f"one), got {a.nbytes}")
                return a
            raise TypeError(f"{where}: a by-value struct needs a NumPy scalar/record of its exact bytes, "
                            f"got {type(a).__name__}")
        return conv
    t = p.np_type
    if t == "bfloat16":
        def conv(a, dev):
            if isinstance(a, (bool, np.bool_)) or not isinstance(a, (int, float, np.integer, np.floating)):
                raise TypeError(f"{where} must be a real number, got {type(a).__name__}")
            return _bf16_bits(float(a))
        return conv
    if issubclass(t, np.bool_):
        def conv(a, dev):
            if not isinstance(a, (bool, np.bool_)):
                raise TypeError(f"{where} must be a bool, got {type(a).__name__}")
            return np.bool_(a)
        return conv
    if issubclass(t, np.integer):
        info = np.iinfo(t)

        def conv(a, dev):
            if isinstance(a, (bool, np.bool_)) or not isinstance(a, (int, np.integer)):
                raise TypeError(f"{where} must be an integer, got {type(a).__name__} {a!r}")
            a = int(a)
            if not info.min <= a <= info.max:
                raise OverflowError(f"{where}: {a} does not fit in {p.ctype} [{info.min}, {info.max}]")
            return t(a)
        return conv

    def conv(a, dev):
        if isinstance(a, (bool, np.bool_)) or not isinstance(a, (int, float, np.integer, np.floating)):
            raise TypeError(f"{where} must be a real number, got {type(a).__name__}")
        return t(a)
    return conv


def _foreign_pointer(a, dev: int, where: str):
    """Device pointer of a non-CuPy array (``__cuda_array_interface__``, DLPack, torch)."""
    import cupy
    ptr = owner = None
    cai = None
    try:
        cai = a.__cuda_array_interface__
    except (AttributeError, TypeError, ValueError):   # torch raises TypeError for bfloat16
        pass
    if cai is not None:
        ptr = int(cai["data"][0])
    elif hasattr(a, "data_ptr") and hasattr(a, "device"):   # torch tensors of dtypes CAI cannot name
        if getattr(a.device, "type", None) != "cuda":
            raise LaunchError(f"{where}: tensor is on {a.device}, not on a CUDA device")
        ptr, owner = int(a.data_ptr()), a.device.index
    elif hasattr(a, "__dlpack_device__"):
        kind, owner = a.__dlpack_device__()
        if int(kind) not in (2, 13):   # kDLCUDA, kDLCUDAManaged
            raise LaunchError(f"{where}: DLPack array is not in CUDA device memory (device type {int(kind)})")
        return _check_dev(cupy.from_dlpack(a), dev, where)
    elif isinstance(a, cupy.cuda.MemoryPointer):
        if a.device_id != dev:
            raise LaunchError(f"{where}: memory is on device {a.device_id}, but the launch is on device {dev}")
        return a
    else:
        raise TypeError(f"{where} expects a device array (CuPy array, __cuda_array_interface__ or DLPack object) "
                        f"or None, got {type(a).__name__}")
    if ptr and owner is None:
        owner = cupy.cuda.runtime.pointerGetAttributes(ptr).device
    if ptr and owner != dev:
        raise LaunchError(f"{where}: array is on device {owner}, but the launch is on device {dev}")
    return np.uint64(ptr)


def _check_dev(arr, dev: int, where: str):
    if arr.data.device_id != dev:
        raise LaunchError(f"{where}: array is on device {arr.data.device_id}, but the launch is on device {dev}")
    return arr


# ---- the public compile entry points -----------------------------------------------------
_ARCH_SPECIFIC = re.compile(r"rtk/sm90\.cuh|\bwgmma\.|\bsetmaxnreg\.")


def resolve_arch(arch: str | None, arch_specific: bool = False) -> str:
    arch = arch or device.current_arch()
    kind, num, suffix = parse_arch(arch)
    if kind != "sm":
        raise ConfigError.bad_value("compile", "arch", arch, "a real GPU arch like 'sm_90' (CUBIN is built for it)")
    if arch_specific and not suffix and int(num) >= 90:
        arch = f"sm_{num}a"   # wgmma/setmaxnreg exist only in the arch-specific target
    return arch


def get_kernel(config, kernel: str | None = None, *, arch: str | None = None, options: CompileOptions | None = None,
               output: str = "cubin") -> Kernel:
    """The kernel ``kernel`` (default: the family's first) of a family config, memoized in process."""
    memo_key = _memo_key(config, kernel, arch, options, output)
    k = _memo.get(memo_key)
    if k is not None:
        return k
    name = kernel or config.kernels[0]
    if name not in config.kernels:
        raise ConfigError.bad_value(config.family, "kernel", name, "one of " + ", ".join(config.kernels))
    if output not in ("cubin", "ptx"):
        raise ConfigError.bad_value(config.family, "output", output, "'cubin' or 'ptx'")
    target = resolve_arch(arch, config.needs_arch_specific)
    params = config.template_params()
    if config.module_per_kernel:
        params["entry"] = name
    module = build_module(config.template, params, label=config.family,
                          config_repr=config.key(), arch=target, options=options or config.compile_options(),
                          output=output)
    k = Kernel(module, name, config)
    with _memo_lock:
        _memo[memo_key] = k
    return k


def _memo_key(config, kernel, arch, options, output) -> tuple:
    return config, kernel, arch, options, output, os.environ.get("RTKERNELS_ARCH")


def get_kernels(config, names: Sequence[str] | None = None, *, arch: str | None = None,
                options: CompileOptions | None = None) -> tuple[Kernel, ...]:
    """Several entry points of a family config (default: all of ``config.kernels``), as
    :func:`get_kernel` gives each.  A family that compiles a module per kernel
    (``module_per_kernel``) gets the modules not yet built compiled at once on threads: NVRTC
    runs without the GIL, so a cold call waits for its slowest module instead of their sum (the
    Hopper backward's three: 0.45 -> 0.40 s at d128 causal, NVRTC 13.5, 2 cores)."""
    names = tuple(names or config.kernels)
    if not config.module_per_kernel or len(names) < 2:
        return tuple(get_kernel(config, n, arch=arch, options=options) for n in names)
    hits = [_memo.get(_memo_key(config, n, arch, options, "cubin")) for n in names]
    if all(h is not None for h in hits):
        return tuple(hits)
    import concurrent.futures as cf
    with cf.ThreadPoolExecutor(max_workers=len(names), thread_name_prefix="rtk-compile") as ex:
        futures = [ex.submit(get_kernel, config, n, arch=arch, options=options) for n in names]
        return tuple(f.result() for f in futures)


def compile_template(template: Template, *, kernel: str | None, arch: str | None, options: CompileOptions | None,
                     output: str, params: dict) -> Kernel:
    from .config import check_user_params
    if output not in ("cubin", "ptx"):
        raise ConfigError.bad_value(template.name, "output", output, "'cubin' or 'ptx'")
    params = check_user_params(params, template.name)
    memo_key = (template, tuple(sorted(params.items())), kernel, arch, options, output,
                os.environ.get("RTKERNELS_ARCH"))
    k = _memo.get(memo_key)
    if k is not None:
        return k
    # A template that uses Hopper's arch-specific instructions (directly or through rtk/sm90.cuh)
    # needs the sm_90a target on an sm_90 device; plain sm_90 would reject wgmma/setmaxnreg.
    target = resolve_arch(arch, bool(_ARCH_SPECIFIC.search(template.text)))
    exprs: tuple = ()
    if kernel is None:
        names = kernel_names(render(template, params, family=template.name).source)
        if len(names) != 1:
            found = ", ".join(names) if names else 'no extern "C" __global__ function'
            raise ConfigError(f"{template.name}: pass kernel=... to pick the entry point; the template defines "
                              f"{found}",
                              field="kernel", value=None, allowed=", ".join(names))
        kernel = names[0]
    elif not re.match(r"^[A-Za-z_]\w*$", kernel):
        exprs = (kernel,)   # a C++ name expression such as "scale<float, 4>"
    label = os.path.basename(template.name) if template.path else template.name
    config_repr = ", ".join(f"{k}={v!r}" for k, v in sorted(params.items()))
    module = build_module(template, params, label=label, config_repr=config_repr, arch=target,
                          options=options or CompileOptions(), output=output, name_expressions=exprs)
    if not exprs and kernel not in kernel_names(module.source) and parse_signature(module.source, kernel) is None:
        raise ConfigError(f"{label}: no __global__ function named {kernel!r}; found "
                          f"{', '.join(kernel_names(module.source)) or 'none'}", field="kernel", value=kernel)
    k = Kernel(module, kernel)
    with _memo_lock:
        _memo[memo_key] = k
    return k
