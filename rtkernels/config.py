"""Kernel configurations: one frozen dataclass per kernel family.

A config is the single source of truth for a specialization (dtype, tile sizes,
head dimension, ...).  It is validated in ``__post_init__`` - before anything is
rendered or compiled - and exposes:

* ``family`` / ``template``: the family name and its ``templates/<family>.cu.j2``;
* ``kernels``: the ``extern "C"`` entry points the template defines;
* ``template_params()``: the values the template sees (fields + derived values);
* ``key()``: a stable string used by the in-process memo and the disk cache.

Families register themselves with :func:`register_family` so ``rtk.compile("name",
**params)`` and the CLI can find them by name.
"""
from __future__ import annotations

import dataclasses
import keyword
import re
from typing import Any, ClassVar, Iterable

from . import dtypes
from .errors import ConfigError

_FAMILIES: dict[str, type["KernelConfig"]] = {}


def register_family(cls: type["KernelConfig"]) -> type["KernelConfig"]:
    """Class decorator: make a config class reachable by its ``family`` name."""
    _FAMILIES[cls.family] = cls
    return cls


def families() -> dict[str, type["KernelConfig"]]:
    """All registered families, name -> config class.  The built-in ones register when
    ``rtkernels`` is imported (its ``__init__`` imports ``rtkernels.ops``, and importing any
    ``rtkernels.*`` module imports the package first), so this module imports no op: the
    config -> ops back-edge of the import graph is gone."""
    return dict(_FAMILIES)


def family_config(name: str) -> type["KernelConfig"]:
    fams = families()
    if name not in fams:
        raise ConfigError(f"unknown kernel family {name!r}; known families: {', '.join(sorted(fams))} "
                          "(or pass a path to your own .cu.j2 template, or rtk.Template(text))",
                          field="family", value=name, allowed=", ".join(sorted(fams)))
    return fams[name]


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Base class of every family's config.  Subclasses are frozen dataclasses."""

    family: ClassVar[str] = ""
    template: ClassVar[str] = ""
    kernels: ClassVar[tuple[str, ...]] = ()
    # True: each entry point of ``kernels`` is compiled as a module of its own (the template sees
    # ``entry``, the kernel's name, and emits only that one), so a caller that launches one of them
    # pays NVRTC for that one alone; False: one module holds them all.
    module_per_kernel: ClassVar[bool] = False
    # Hopper-only instructions (wgmma, setmaxnreg) need the arch-specific target sm_90a.
    needs_arch_specific: ClassVar[bool] = False
    # The SASS a healthy build of this family must contain (checked by `rtk inspect`).
    expects_tensor_cores: ClassVar[bool] = False
    expected_global_width: ClassVar[int | None] = None  # bits; e.g. 128 for vectorized families

    # ---- what subclasses may override -------------------------------------------------
    def template_params(self) -> dict[str, Any]:
        """Values visible to the template: every field, plus derived values of subclasses; a
        module-per-kernel family's ``entry`` (None: every entry point; get_kernel names one)."""
        p = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.module_per_kernel:
            p["entry"] = None
        return p

    def compile_options(self):
        """NVRTC options for this config (a :class:`rtkernels.compiler.CompileOptions`)."""
        from .compiler import CompileOptions
        return CompileOptions()

    # ---- shared -----------------------------------------------------------------------
    def key(self) -> str:
        items = ",".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
        return f"{self.family}({items})"

    def replace(self, **changes) -> "KernelConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_params(cls, params: dict[str, Any], arch: str | None = None) -> "KernelConfig":
        """Build from keyword parameters, with a ConfigError naming any unknown one.

        Families with heuristics fill the fields not given (tile sizes) for ``arch`` by
        overriding :meth:`heuristic_defaults`; ``rtk.compile("attention", head_dim=80)`` and
        ``rtk report attention --sweep head_dim=...`` then build exactly what the op would run.
        """
        params = {**cls.heuristic_defaults(params, arch), **params}
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [p for p in params if p not in names]
        if unknown:
            raise ConfigError(f"{cls.family}: unknown parameter(s) {', '.join(map(repr, unknown))}; "
                              f"{cls.family} takes {', '.join(names)}",
                              family=cls.family, field=unknown[0], value=params[unknown[0]],
                              allowed=", ".join(names))
        return cls(**params)

    @classmethod
    def heuristic_defaults(cls, params: dict[str, Any], arch: str | None) -> dict[str, Any]:
        """Field values the family's heuristics choose given the other ``params`` (default: none)."""
        return {}

    # validation helpers, used by subclasses' __post_init__
    def _fail(self, field: str, allowed: str) -> None:
        raise ConfigError.bad_value(self.family, field, getattr(self, field), allowed)

    def _check_dtype(self, field: str, allowed: Iterable[str]) -> None:
        allowed = tuple(allowed)
        value = dtypes.canonical(getattr(self, field), family=self.family, field=field, allowed=allowed)
        object.__setattr__(self, field, value)

    def _check_int(self, field: str, lo: int, hi: int, *, power_of_two: bool = False,
                   multiple_of: int | None = None) -> None:
        v = getattr(self, field)
        ok = isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi
        if ok and power_of_two:
            ok = v & (v - 1) == 0
        if ok and multiple_of:
            ok = v % multiple_of == 0
        if not ok:
            what = "a power of two" if power_of_two else (f"a multiple of {multiple_of}" if multiple_of
                                                          else "an integer")
            self._fail(field, f"{what} in [{lo}, {hi}]")

    def _check_choice(self, field: str, choices: Iterable[Any]) -> None:
        choices = tuple(choices)
        if getattr(self, field) not in choices:
            self._fail(field, "one of " + ", ".join(map(repr, choices)))


# ---- user templates --------------------------------------------------------------------
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def check_user_params(params: dict[str, Any], where: str) -> dict[str, Any]:
    """Parameters of a user template: ints, floats, bools or dtype names, nothing else.

    Strings that are not dtype names never reach a template: that keeps arbitrary text
    out of generated source and out of the cache key's meaning.
    """
    out: dict[str, Any] = {}
    for name, value in sorted(params.items()):
        if not _IDENT.match(name) or keyword.iskeyword(name):
            raise ConfigError(f"{where}: parameter name {name!r} is not a valid identifier",
                              family=where, field=name, value=value, allowed="identifiers")
        if isinstance(value, (bool, int, float)):
            out[name] = value
        elif isinstance(value, str) or hasattr(value, "itemsize") or "torch." in str(value):
            try:
                out[name] = dtypes.canonical(value, family=where, field=name)
            except ConfigError:
                raise ConfigError.bad_value(where, name, value, "an int, float, bool or dtype name ("
                                            + ", ".join(dtypes.DTYPES) + ")") from None
        else:
            raise ConfigError.bad_value(where, name, value,
                                        "an int, float, bool or dtype name (" + ", ".join(dtypes.DTYPES) + ")")
    return out
