"""The wheel, not only the editable install, carries the templates and the generated modules.

Builds a wheel from a copy of the project (offline: no build isolation, no
dependencies fetched), installs it into a fresh venv that sees this
interpreter's numpy, sympy and jinja2 but not the editable symattn, then runs
`symattn generate --spec attention --spec mha --out <tmp>` there and imports a generated module.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # builds and installs a wheel

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "symattn", "generated", "templates")


def run(*args, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONNOUSERSITE": "1"}
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300, **kwargs)
    assert done.returncode == 0, f"{' '.join(map(str, args))} failed:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("setuptools", reason="building the wheel needs setuptools")
    source = tmp_path_factory.mktemp("source")
    for name in SOURCES:
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        copy(
            ROOT / name,
            source / name,
            **({"ignore": shutil.ignore_patterns("__pycache__")} if copy is shutil.copytree else {}),
        )
    out = tmp_path_factory.mktemp("wheel")
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(source))
    (built,) = out.glob("symattn-*.whl")
    return built


def test_wheel_holds_templates_and_generated_modules(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "symattn/templates/numpy_module.py.j2" in names
    assert "symattn/templates/torch_module.py.j2" in names
    assert "symattn/templates/jax_module.py.j2" in names
    for module in ("attention_numpy", "self_attention_torch", "mha_numpy", "mha_torch_memeff", "mha_jax"):
        assert f"symattn/generated/{module}.py" in names


def test_installed_wheel_generates_and_imports(wheel, tmp_path):
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", str(venv))
    python = venv / ("Scripts" if os.name == "nt" else "bin") / "python"
    site = Path(run(str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    # this interpreter's packages (numpy, sympy, jinja2), without running its .pth files (the editable symattn)
    (site / "system.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run(sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", str(wheel))
    out = tmp_path / "out"
    # two specs (every module of them: each backend and variant), not the whole set: the templates are the same
    two = ("--spec", "attention", "--spec", "mha")
    run(str(python), "-m", "symattn", "generate", *two, "--out", str(out), cwd=tmp_path)
    assert sorted(p.name for p in out.glob("*_numpy.py")) == ["attention_numpy.py", "mha_numpy.py"]
    check = (
        "import numpy as np, symattn, symattn.generated.attention_numpy as g; "
        "assert 'site-packages' in symattn.__file__, symattn.__file__; "
        "o, s = g.forward(np.ones((2, 3, 4)), np.ones((2, 5, 4)), np.ones((2, 5, 2))); "
        "print(sorted(g.backward(s, np.ones_like(o))))"
    )
    assert run(str(python), "-c", check, cwd=tmp_path).stdout.strip() == "['K', 'Q', 'V']"
    generated = (out / "mha_torch.py").read_bytes()
    assert generated == (ROOT / "generated" / "mha_torch.py").read_bytes()  # same bytes from the wheel
