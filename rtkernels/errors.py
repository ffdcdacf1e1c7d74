"""Exceptions raised by rtkernels.

Every message names what was wrong (family, parameter, value) and what is
allowed, so a user can act on it without reading our source.
"""
from __future__ import annotations


class RtkError(Exception):
    """Base class of every rtkernels error."""


class ConfigError(RtkError, ValueError):
    """A kernel configuration or an op's input is invalid; nothing was compiled or launched."""

    def __init__(self, message: str, *, family: str | None = None, field: str | None = None,
                 value: object = None, allowed: str | None = None):
        self.family, self.field, self.value, self.allowed = family, field, value, allowed
        super().__init__(message)

    @classmethod
    def bad_value(cls, family: str, field: str, value: object, allowed: str) -> "ConfigError":
        return cls(f"{family}: {field}={value!r} is not allowed; {field} must be {allowed}",
                   family=family, field=field, value=value, allowed=allowed)


class CompileError(RtkError, RuntimeError):
    """NVRTC rejected the rendered source, or a template failed to render."""

    def __init__(self, message: str, *, log: str = "", source_path: str | None = None, source: str = ""):
        self.log = log
        self.source_path = source_path
        self.source = source   # the rendered source NVRTC rejected ("" for render errors)
        super().__init__(message)

    def note_source_path(self, path: str) -> None:
        """Record where the rendered source was saved, and say so at the end of the message."""
        self.source_path = path
        self.args = (f"{self.args[0]}\nrendered source saved to {path}",) + self.args[1:]


class LaunchError(RtkError, RuntimeError):
    """A kernel could not be loaded or launched (bad arguments, wrong device, driver error)."""


class DeviceError(RtkError, RuntimeError):
    """No usable CUDA device, or the driver is too old for what was asked."""
