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


def _library_folders() -> tuple[str, ...]:
    import torch

    folders = [Path(torch.__file__).parent, Path(__file__).resolve().parents[1]]  # torch's, symattn's
    folders += [Path(sysconfig.get_paths()[key]) for key in ("stdlib", "platstdlib")]
    return tuple(str(f.resolve()) + os.sep for f in folders)


_LIBRARIES: tuple[str, ...] = ()


def is_user(frame: FrameType) -> bool:
    """Is the frame's code the user's (not torch's, symattn's or the standard library's)?"""
    global _LIBRARIES
    if not _LIBRARIES:
        _LIBRARIES = _library_folders()
    file = frame.f_code.co_filename
    if file not in _USER:
        _USER[file] = not file.startswith("<frozen") and not os.path.realpath(file).startswith(_LIBRARIES)
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
