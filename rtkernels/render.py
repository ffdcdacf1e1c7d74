"""Render Jinja2 kernel templates into CUDA source with ``#line`` directives.

The environment is strict (``StrictUndefined``): a missing value is an error, never an
empty string in generated code.  Before Jinja parses a template we tag every source line
with an invisible marker; after rendering, the markers become ``#line`` directives.  NVRTC
then reports errors against the ``.cu.j2`` file and line the user wrote, not against a
rendered file they never saw.  ``Rendered.source`` is the clean text (no markers, no
``#line``); ``Rendered.compiled_source`` is what NVRTC gets.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import traceback
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import Extension

from . import dtypes
from .errors import CompileError

_MARK = re.compile(r"/\*@rtk:(\d+):(\d+)\*/")
_STATEMENT_ONLY = re.compile(r"^\s*(\{%.*%\}|\{#.*#\})\s*$")


def template_dir() -> Path:
    """Folder of the built-in templates: inside the installed wheel, else the source tree."""
    packaged = Path(__file__).resolve().parent / "templates"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent / "templates"


def include_dir() -> Path:
    """Folder passed to NVRTC with -I; device headers are included as "rtk/<name>.cuh"."""
    return template_dir() / "include"


class _LineMarkers(Extension):
    """Tag each template line with its (file, line) so rendering keeps the origin."""

    def preprocess(self, source: str, name: str | None, filename: str | None = None) -> str:
        files: list[str] = self.environment.rtk_files  # type: ignore[attr-defined]
        label = filename or name or self.environment.rtk_default_name  # type: ignore[attr-defined]
        if label not in files:
            files.append(label)
        fid = files.index(label)
        out = []
        in_raw = in_comment = False
        open_tags = 0  # Jinja {{ / {% tags spanning lines: a marker there would break the tag
        for i, line in enumerate(source.split("\n"), 1):
            if "{% raw" in line or "{%- raw" in line:
                in_raw = True
            starts_in_tag = open_tags > 0
            open_tags += line.count("{{") + line.count("{%") - line.count("}}") - line.count("%}")
            in_comment = _ends_in_block_comment(line, in_comment)
            plain = (not in_raw and not in_comment and not starts_in_tag and open_tags == 0
                     and line.strip() and not line.rstrip().endswith("\\")
                     and not _STATEMENT_ONLY.match(line) and "{#" not in line)
            out.append(f"{line}/*@rtk:{fid}:{i}*/" if plain else line)
            if "endraw" in line:
                in_raw = False
        return "\n".join(out)


def _ends_in_block_comment(line: str, in_comment: bool) -> bool:
    """Whether a C block comment is still open at the end of ``line``."""
    i = 0
    while i < len(line) - 1:
        pair = line[i:i + 2]
        if in_comment and pair == "*/":
            in_comment, i = False, i + 2
        elif not in_comment and pair == "/*":
            in_comment, i = True, i + 2
        elif not in_comment and pair == "//":
            break
        else:
            i += 1
    return in_comment


def _display_name(path: str) -> str:
    """Built-in templates are shown relative to the templates folder (stable across installs)."""
    try:
        return "templates/" + Path(path).resolve().relative_to(template_dir()).as_posix()
    except ValueError:
        return path


def _new_environment(search: list[str]) -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(search),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
        extensions=[_LineMarkers],
    )
    env.rtk_files = []  # type: ignore[attr-defined]
    env.rtk_default_name = "<template>"  # type: ignore[attr-defined]
    env.filters["ctype"] = dtypes.ctype
    env.filters["itemsize"] = dtypes.itemsize
    env.globals["ctype"] = dtypes.ctype
    return env


@lru_cache(maxsize=None)
def _environment(search: tuple[str, ...]) -> jinja2.Environment:
    return _new_environment(list(search))


@dataclasses.dataclass(frozen=True)
class Template:
    """A kernel template given by the user: its text, or a path to a ``.cu.j2`` file.

    >>> t = rtk.Template('extern "C" __global__ void scale({{ dtype | ctype }}* x) {}')
    >>> k = rtk.compile(t, kernel="scale", dtype="float32")
    """

    text: str
    name: str = "<template>"
    path: str | None = None

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "Template":
        p = Path(path).expanduser().resolve()
        try:
            text = p.read_text()
        except OSError as exc:
            from .errors import ConfigError
            raise ConfigError(f"cannot read template {str(path)!r}: {exc.strerror}",
                              field="template", value=str(path), allowed="a readable .cu.j2 file") from None
        return cls(text=text, name=str(p), path=str(p))

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class Rendered:
    source: str            # clean CUDA source, as a user reads it
    compiled_source: str   # the same with #line directives, given to NVRTC
    line_map: tuple        # compiled line number (1-based) -> (file, line) or None
    template_files: tuple  # every template file that took part (for error excerpts)


def render(template: str | Template, params: dict[str, Any], *, family: str = "") -> Rendered:
    """Render a built-in template (by file name) or a user :class:`Template`."""
    search = [str(template_dir())]
    if isinstance(template, Template) and template.path:
        search.insert(0, str(Path(template.path).parent))
    env = _new_environment(search) if isinstance(template, Template) else _environment(tuple(search))
    # rtk_files only grows: Jinja caches preprocessed templates, whose markers keep their file ids
    if isinstance(template, Template):
        env.rtk_default_name = template.name  # type: ignore[attr-defined]
    label = family or (template.name if isinstance(template, Template) else template)
    try:
        if isinstance(template, Template):
            jt = env.from_string(template.text) if template.path is None else env.get_template(
                Path(template.path).name)
        else:
            jt = env.get_template(template)
        text = jt.render(**params)
    except jinja2.TemplateSyntaxError as exc:
        where = exc.filename or exc.name or (template.name if isinstance(template, Template) else template)
        raise CompileError(f"{label}: template syntax error in {_display_name(where)}, line {exc.lineno}: "
                           f"{exc.message}") from None
    except jinja2.TemplateNotFound as exc:
        raise CompileError(f"{label}: template {exc.name!r} not found (searched {', '.join(search)})") from None
    except jinja2.UndefinedError as exc:
        where = _template_frame(exc)
        raise CompileError(f"{label}: template error{where}: {exc.message}; parameters given: "
                           f"{', '.join(sorted(params)) or '(none)'}") from None
    except Exception as exc:  # a filter raising ConfigError, a Jinja runtime error, ...
        from .errors import ConfigError
        if isinstance(exc, ConfigError):
            raise
        where = _template_frame(exc)
        raise CompileError(f"{label}: template error{where}: {exc}") from None
    files = [_display_name(f) for f in env.rtk_files]  # type: ignore[attr-defined]
    return _add_line_directives(text, files)


def _template_frame(exc: BaseException) -> str:
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if frame.filename.endswith(".j2") or frame.filename == "<template>":
            return f" in {_display_name(frame.filename)}, line {frame.lineno}"
    return ""


def _add_line_directives(text: str, files: list[str]) -> Rendered:
    clean: list[str] = []
    compiled: list[str] = []
    line_map: list = []
    prev = None  # (fid, line) of the last emitted line
    for line in text.split("\n"):
        marks = _MARK.findall(line)
        stripped = _MARK.sub("", line)
        clean.append(stripped)
        if marks:
            fid, ln = int(marks[0][0]), int(marks[0][1])
            origin = (files[fid], ln)
            if prev is None or prev != (files[fid], ln - 1):
                compiled.append(f'#line {ln} "{files[fid]}"')
                line_map.append(None)
            prev = origin
        else:
            origin = (prev[0], prev[1] + 1) if prev else None
            prev = origin
        compiled.append(stripped)
        line_map.append(origin)
    return Rendered("\n".join(clean), "\n".join(compiled), tuple(line_map), tuple(files))
