"""rtkernels: runtime-compiled, Jinja2-templated CUDA kernels for CuPy.

Templates are rendered per configuration, compiled to CUBIN for the exact GPU by NVRTC
(through cuda-python), cached in memory and on disk, inspected (PTX, SASS, registers,
spills, occupancy) and launched on CuPy arrays.
"""
from __future__ import annotations

import os
from typing import Any

from . import arch, cache, device, inspect
from ._version import __version__
from .compiler import CompileOptions, Resources
from .config import KernelConfig, families, register_family
from .errors import CompileError, ConfigError, DeviceError, LaunchError, RtkError
from .kernel import Kernel, get_kernel, get_kernels
from .render import Template


def compile(family_or_template: Any, *, arch: str | None = None, kernel: str | None = None,
            options: CompileOptions | None = None, output: str = "cubin", **params: Any) -> Kernel:
    """Render, compile (or fetch from the cache) and return a kernel.

    Parameters
    ----------
    family_or_template : a built-in family name (``"vector_add"``), a family config object,
        a path to your own ``.cu.j2`` file, or an :class:`rtkernels.Template`.
    arch : target such as ``"sm_90"``; default ``RTKERNELS_ARCH``, else the current GPU, else sm_90.
    kernel : entry point; default the family's first, or the only ``extern "C"`` kernel of a template.
        For C++ template kernels give a name expression such as ``"scale<float>"``.
    options : :class:`CompileOptions` (default: the family's own).
    output : ``"cubin"`` (default; loads on any driver) or ``"ptx"``.
    **params : the configuration: family fields, or a user template's parameters (ints, floats,
        bools or dtype names).

    Raises
    ------
    ConfigError : a parameter is invalid (before anything compiles).
    CompileError : the template or NVRTC failed; the message locates the error in the template.
    """
    from .kernel import compile_template
    from .config import family_config
    if isinstance(family_or_template, KernelConfig):
        if params:
            family_or_template = family_or_template.replace(**params)
        return get_kernel(family_or_template, kernel, arch=arch, options=options, output=output)
    if isinstance(family_or_template, Template):
        return compile_template(family_or_template, kernel=kernel, arch=arch, options=options, output=output,
                                params=params)
    if isinstance(family_or_template, os.PathLike) or (
            isinstance(family_or_template, str)
            and (family_or_template.endswith(".j2") or os.sep in family_or_template or "/" in family_or_template)):
        return compile_template(Template.from_file(family_or_template), kernel=kernel, arch=arch, options=options,
                                output=output, params=params)
    if not isinstance(family_or_template, str):
        raise TypeError("compile() takes a family name, a config, a template path or rtk.Template, "
                        f"not {type(family_or_template).__name__}")
    cfg = family_config(family_or_template).from_params(params, arch)
    return get_kernel(cfg, kernel, arch=arch, options=options, output=output)


from . import ops as _ops  # noqa: E402

_ops_all = []
for _mod, _names in _ops.PUBLIC.items():
    for _name in _names:
        globals()[_name] = getattr(getattr(_ops, _mod), _name)
        _ops_all.append(_name)

__all__ = ["compile", "get_kernel", "get_kernels", "Kernel", "Template", "CompileOptions", "Resources", "KernelConfig",
           "register_family", "families", "CompileError", "ConfigError", "LaunchError", "DeviceError",
           "RtkError", "arch", "cache", "device", "inspect", "__version__", *_ops_all]
