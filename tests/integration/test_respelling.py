"""One function, one code (issue 25, item 5b): every built-in and gallery spec respelled automatically.

``symattn.specs.respell.respellings`` writes each spec seven ways (intermediates named or not, sums and
entrywise products reversed, the scalar of a product moved onto a factor or split in two, named). Each
spelling's generated schedule must cost the same forward and backward FLOPs and make the same number of
full n × m arrays as the spec as written; the gallery's respellings must also compute the same numbers.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from symattn.codegen import generate as codegen
from symattn.codegen.report.cost_report import schedule_counts
from symattn.specs import spec, specs
from symattn.specs.files import load_spec_file
from symattn.specs.respell import respellings

sys.path.insert(0, str(Path(__file__).parent))
from test_gallery import GALLERY, NAMES, TOLERANCE, _case, _relative

SIZES = {"n": 1024, "m": 768, "d_model": 256, "d_k": 64, "d_v": 48, "H": 4, "H_kv": 2, "d_ff": 1024}


def _specs() -> dict:
    """Every built-in (renamed: a built-in's own name stands for its generated modules) and gallery spec."""
    found = {name: dataclasses.replace(spec(name), name=f"{name}_as_a_user_spec") for name in specs()}
    found.update({name: load_spec_file(GALLERY / f"{name}.py") for name in NAMES})
    return found


SPECS = _specs()


def _cost(s) -> tuple[float, float, int]:
    """Forward and backward FLOPs of s's generated schedule at SIZES (FLOPs are whole numbers), and its n × m arrays."""
    fwd, bwd, arrays = schedule_counts(s, SIZES)
    return round(fwd), round(bwd), arrays


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_spelling_costs_the_same(name):
    """Identical forward and backward FLOPs and n × m arrays, whichever way the spec is written."""
    variants = respellings(SPECS[name])
    written = _cost(variants.pop("as written"))
    for label, variant in variants.items():
        assert _cost(variant) == written, label


def test_the_respellings_are_respellings():
    """Each spelling differs from the spec as written (names, order of terms, scalars named), same output shape."""
    s = SPECS["transformer_block"]
    variants = respellings(s)
    written = variants.pop("as written")
    for label, variant in variants.items():
        assert (variant.output, variant.intermediates) != (written.output, written.intermediates), label
        assert variant.output.shape == written.output.shape
    scaled = variants["scale split over two factors, named"].intermediates
    assert sum(label.startswith("c") for label, _ in scaled) >= 2


def _module(s) -> types.ModuleType:
    made = types.ModuleType(f"{s.name}_respelt")
    exec(compile(codegen.render(s, "numpy", second_order=False), made.__name__, "exec"), made.__dict__)
    return made


@pytest.mark.parametrize("name", NAMES)
def test_every_spelling_of_a_gallery_spec_computes_the_same_gradients(name):
    """The generated NumPy module of each spelling against torch autograd of the gallery's reference forward."""
    values, g, _, want = _case(name, "float64", seed=3)
    for label, variant in respellings(SPECS[name]).items():
        made = _module(variant)
        out, saved = made.forward(*values.values())
        grads = made.backward(saved, g)
        errors = {k: _relative(grads[k], want[k]) for k in values}
        assert max(errors.values()) <= TOLERANCE["float64"], (label, errors)
        assert np.all(np.isfinite(out))
