"""Which frames are the user's code (``trace.frames``): what a refusal points at and where tensors get names."""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

import pytest

pytest.importorskip("torch")

from symattn.trace.frames import is_user_file

PATHS = sysconfig.get_paths()


def test_installed_packages_are_user_code_and_the_standard_library_is_not():
    """An installed package (transformers' modeling_bert.py) is code the user runs: a refusal names its line and
    its locals name the tensors. In a virtual environment sysconfig's platstdlib is the venv's lib/, the parent
    of site-packages: excluding it excluded every installed package."""
    site = Path(PATHS["purelib"]) / "transformers" / "models" / "bert" / "modeling_bert.py"
    assert is_user_file(str(site))
    assert not is_user_file(json.__file__)  # the standard library
    assert not is_user_file(os.path.join(PATHS["stdlib"], "functools.py"))
    assert not is_user_file(str(Path(PATHS["platstdlib"]) / "collections" / "__init__.py"))


def test_torch_and_symattn_are_not_user_code():
    import torch

    import symattn

    assert not is_user_file(torch.__file__)
    assert not is_user_file(symattn.__file__)
    assert is_user_file(__file__)
    assert not is_user_file("<frozen importlib._bootstrap>")
