"""The JAX backend without jax: rendering, the CLI, and importing symattn.generated all need no jax;
the memory-efficient variant is not generated for jax, and asking for it is a clear error."""

from __future__ import annotations

import subprocess
import sys

import pytest

from symattn.cli import main
from symattn.codegen import generate as codegen
from symattn.errors import SymattnError

BLOCK_JAX = "import sys; sys.modules['jax'] = None; sys.modules['jax.numpy'] = None; "  # import jax fails


def test_generated_package_and_runtime_import_without_jax():
    code = BLOCK_JAX + (
        "import symattn.generated, symattn.codegen.backends.jax.runtime\n"
        "from symattn.generated import mha_numpy\n"
        "from symattn.codegen import generate as g\n"
        "assert 'import jax' in g.render('attention', 'jax')\n"
        "try:\n    from symattn.generated import mha_jax\nexcept ImportError:\n    print('needs jax')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "needs jax", out.stderr


def test_jax_modules_write_nothing_in_place():
    for spec in ("attention", "mha", "transformer_block"):
        text = codegen.render(spec, "jax")
        arrays = text.replace("__(", "").replace("OPTIONAL +=", "")  # (a tuple of names grows: no array)
        assert "out=" not in arrays and "_(" not in arrays and "+=" not in arrays, spec


def test_memeff_is_not_generated_for_jax_and_asking_is_an_error(tmp_path, capsys):
    with pytest.raises(SymattnError, match="jax backend has no memeff variant"):
        codegen.render("attention", "jax", "memeff")
    assert main(["generate", "--spec", "attention", "--backend", "jax", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.glob("*.py")) == ["attention_jax.py"]
    capsys.readouterr()
    args = ["generate", "--spec", "attention", "--backend", "jax", "--variant", "memeff", "--out", str(tmp_path)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "jax backend has no memeff variant" in err and len(err.splitlines()) == 1
    # every backend's memory-efficient variant: the ones that exist
    assert main(["generate", "--spec", "attention", "--variant", "memeff", "--out", str(tmp_path)]) == 0
    assert not (tmp_path / "attention_jax_memeff.py").exists() and (tmp_path / "attention_torch_memeff.py").exists()
