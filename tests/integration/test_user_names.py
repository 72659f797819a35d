"""A user's spec names what it likes, except the generated code's own names; what generate cannot honour it
refuses in one line, never with wrong numbers.

- an input called ``scale`` (or ``out``) is not shadowed by the generated code's own constants and values,
  in the first closed form or the second (a float64 gradgradcheck);
- an input called like a helper or a variable of the generated code (``grad_out``, ``row_softmax``) is
  refused by name;
- a constant used otherwise than as one additive mask (ALiBi's −slope·Dist) is a forward argument, never
  read from attn_mask.
"""

from __future__ import annotations

import types

import pytest
import sympy as sp

import symattn as sa
from symattn.codegen import generate as codegen
from symattn.errors import SymattnError
from symattn.specs import dim

torch = pytest.importorskip("torch")

n, d = dim("n"), dim("d")
X, W_Q = sp.MatrixSymbol("X", n, d), sp.MatrixSymbol("W_Q", d, d)


def load(spec: sa.Spec) -> types.ModuleType:
    module = types.ModuleType(f"{spec.name}_torch")
    exec(compile(codegen.render(spec, "torch"), module.__name__, "exec"), module.__dict__)
    return module


def scale_spec(name: str) -> sa.Spec:
    """softmax(X W_Q Xᵀ/√d + Z) X ⊙ Z', Z (n × n) and Z' (n × d) inputs called name and name + '2'."""
    z, z2 = sp.MatrixSymbol(name, n, n), sp.MatrixSymbol(name + "2", n, d)
    p = sa.softmax(X * W_Q * X.T / sp.sqrt(d) + z)
    out = sa.hadamard(p * X, z2)
    return sa.Spec(f"named_{name}", "", (X, W_Q, z, z2), out, (("P", p), ("Y", out)))


def reference(x, w, z, z2):
    return torch.softmax(x @ w @ x.mT / x.shape[-1] ** 0.5 + z, dim=-1) @ x * z2


@pytest.mark.parametrize("name", ["scale", "out", "c1", "f2"])
def test_an_input_named_like_a_generated_value_is_not_shadowed(name):
    module = load(scale_spec(name))
    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(*shape, generator=gen, dtype=torch.float64) for shape in ((4, 3), (3, 3), (4, 4), (4, 3))]
    assert torch.allclose(module.forward(*args), reference(*args), rtol=1e-12, atol=1e-12)
    inputs = [a.clone().requires_grad_(True) for a in args]
    assert torch.autograd.gradgradcheck(module.forward, inputs)  # the second closed form's names too


@pytest.mark.parametrize("name", ["grad_out", "row_softmax", "np", "saved", "direction", "SHAPES"])
def test_an_input_named_like_the_generated_code_is_refused_by_name(name):
    spec = scale_spec("Z")
    spec = sa.Spec(
        spec.name,
        "",
        (X, W_Q, sp.MatrixSymbol(name, n, n), spec.inputs[3]),
        spec.output.xreplace({spec.inputs[2]: sp.MatrixSymbol(name, n, n)}),
    )
    with pytest.raises(SymattnError, match=f"'{name}' named in the spec is a name of the generated code"):
        codegen.render(spec, "numpy")


def test_a_constant_that_is_not_an_additive_mask_is_a_forward_argument():
    """ALiBi's −slope·Dist: Dist is a fixed argument after the inputs (no gradient); an additive mask is in its
    position too (None: no mask), attn_mask and the other mask keywords beside it."""
    slope, dist = sp.Symbol("slope", real=True), sp.MatrixSymbol("Dist", n, n)
    out = sa.softmax(X * W_Q * X.T - slope * dist) * X
    text = codegen.render(sa.Spec("alibi", "", (X, W_Q, slope), out, constants=(dist,)), "torch")
    assert "def forward(X, W_Q, slope, Dist):" in text
    masked = sa.Spec("masked", "", (X, W_Q), sa.softmax(X * W_Q * X.T + dist) * X, constants=(dist,))
    assert "def forward(X, W_Q, Dist=None, *, attn_mask=None" in codegen.render(masked, "numpy")


@pytest.mark.parametrize("labels", [("t1", "t2"), ("c1", "D1"), ("D", "t3")])
def test_intermediates_named_like_generated_temporaries_keep_their_values(labels):
    z, z2 = sp.MatrixSymbol("Z", n, n), sp.MatrixSymbol("Z2", n, d)
    p = sa.softmax(X * W_Q * X.T / sp.sqrt(d) + z)
    out = sa.hadamard(p * X, z2)
    module = load(sa.Spec("temporaries", "", (X, W_Q, z, z2), out, ((labels[0], p), (labels[1], out))))
    gen = torch.Generator().manual_seed(1)
    args = [torch.randn(*shape, generator=gen, dtype=torch.float64) for shape in ((4, 3), (3, 3), (4, 4), (4, 3))]
    assert torch.allclose(module.forward(*args), reference(*args), rtol=1e-12, atol=1e-12)
    inputs = [a.clone().requires_grad_(True) for a in args]
    assert torch.autograd.gradcheck(module.forward, inputs)
    assert torch.autograd.gradgradcheck(module.forward, inputs)


def test_an_input_named_like_a_dimension_is_refused():
    k = sp.MatrixSymbol("d", n, n)
    spec = sa.Spec("dim_named", "", (X, W_Q, k), sa.softmax(X * W_Q * X.T + k) * X)
    with pytest.raises(SymattnError, match="'d' named in the spec is a name of the generated code"):
        codegen.render(spec, "numpy")


def test_one_name_for_two_shapes_is_a_spec_error():
    m = dim("m")
    x2 = sp.MatrixSymbol("X", m, d)
    with pytest.raises(SymattnError, match="X is two matrices, n × d and m × d"):
        sa.Spec("two_shapes", "", (X, W_Q), sa.softmax(X * W_Q * x2.T) * x2)
