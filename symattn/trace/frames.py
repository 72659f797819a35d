"""Where in the user's code the trace is: the file:line of an operation, and the names the user gave tensors.

The user's frames are those outside torch, symattn and Python's standard library; the innermost one is
the line an error names, and each one's local variables name the tensors bound to them (``q = …`` names
the value of q "q"), the way the derivation should read.
"""

from __future__ import annotations

import linecache
import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from types import FrameType


def _folders(paths: list[Path]) -> tuple[str, ...]:
    return tuple(str(p.resolve()) + os.sep for p in paths)


def _library_folders() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(torch's and symattn's folders, the standard library's, the installed packages')."""
    import torch

    paths = sysconfig.get_paths()
    return (
        _folders([Path(torch.__file__).parent, Path(__file__).resolve().parents[1]]),
        _folders([Path(paths[key]) for key in ("stdlib", "platstdlib")]),
        _folders([Path(paths[key]) for key in ("purelib", "platlib")]),
    )


_LIBRARIES: tuple[tuple[str, ...], ...] = ()


def is_user_file(file: str) -> bool:
    """Is the file the user's: not torch's or symattn's, and not the standard library's? An installed package
    (transformers' modeling_bert.py) is the user's code: its site-packages folder lies inside the standard
    library's (a system install) or beside it in a virtual environment, whose platstdlib is the venv's lib/."""
    global _LIBRARIES
    if not _LIBRARIES:
        _LIBRARIES = _library_folders()
    ours, standard, installed = _LIBRARIES
    path = os.path.realpath(file)
    if file.startswith("<frozen") or path.startswith(ours):
        return False
    return path.startswith(installed) or not path.startswith(standard)


def is_user(frame: FrameType) -> bool:
    """Is the frame's code the user's (``is_user_file``)?"""
    file = frame.f_code.co_filename
    if file not in _USER:
        _USER[file] = is_user_file(file)
    return _USER[file]


_USER: dict[str, bool] = {}


def user_frames() -> Iterator[FrameType]:
    """The frames of the user's code on the stack, innermost first."""
    frame = sys._getframe(1)
    while frame is not None:
        if is_user(frame):
            yield frame
        frame = frame.f_back


def location() -> str:
    """file:line of the innermost user frame, with the line's text; "" when there is none."""
    frame = next(user_frames(), None)
    if frame is None:
        return ""
    file, line = frame.f_code.co_filename, frame.f_lineno
    shown = os.path.relpath(file) if not os.path.relpath(file).startswith("..") else file
    text = linecache.getline(file, line).strip()
    return f"{shown}:{line}" + (f": `{text}`" if text else "")


def local_names() -> Iterator[tuple[str, object]]:
    """(name, value) of the local variables of the user's frames, innermost frame first."""
    for frame in user_frames():
        yield from list(frame.f_locals.items())
