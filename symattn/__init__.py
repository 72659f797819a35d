"""symattn: closed-form gradients of matrix expressions (Transformer attention above all),
derived by trace differentials, printed step by step, and generated as NumPy and
PyTorch code."""

from __future__ import annotations

from symattn.autodiff.grad import backward, grad
from symattn.derive.check import CheckResult, check
from symattn.derive.derivation import Derivation, derive
from symattn.errors import ShapeMismatchError, SymattnError, UnknownSpecError, UnsupportedNodeError
from symattn.lang.lazy import Matrix, identity, matrix, ones, scalar
from symattn.lang.ops import (
    clamp,
    dropout,
    exp,
    hadamard,
    hardtanh,
    leaky_relu,
    log,
    log_softmax,
    merge_heads,
    relu,
    rowsum,
    sigmoid,
    silu,
    softmax,
    softplus,
    split_heads,
    stop_gradient,
    sum,
    tanh,
)
from symattn.lang.positions import entries
from symattn.numeric.lambdify import lambdify
from symattn.optimize.simplify import simplify, simplify_all
from symattn.specs import Spec, spec, specs
from symattn.specs.masking import with_mask
from symattn.trace.checking import check_backward
from symattn.trace.source import from_torch
from symattn.version import __version__

__all__ = [
    "CheckResult",
    "Derivation",
    "Matrix",
    "ShapeMismatchError",
    "Spec",
    "SymattnError",
    "UnknownSpecError",
    "UnsupportedNodeError",
    "__version__",
    "backward",
    "check",
    "check_backward",
    "clamp",
    "derive",
    "dropout",
    "entries",
    "exp",
    "from_torch",
    "grad",
    "hadamard",
    "hardtanh",
    "identity",
    "lambdify",
    "leaky_relu",
    "log",
    "log_softmax",
    "matrix",
    "merge_heads",
    "ones",
    "relu",
    "rowsum",
    "scalar",
    "sigmoid",
    "silu",
    "simplify",
    "simplify_all",
    "softmax",
    "softplus",
    "spec",
    "specs",
    "split_heads",
    "stop_gradient",
    "sum",
    "tanh",
    "with_mask",
]
