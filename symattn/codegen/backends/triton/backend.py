"""The Triton backend as code generation asks for it: a ``Backend`` whose modules ``module.render_triton`` renders
(the kernels of the spec's n × m core and the torch code around them), standard variant only."""

from __future__ import annotations

from collections.abc import Callable

import jinja2

from symattn.codegen.backends.backend import Backend
from symattn.codegen.backends.triton.printer import TilePrinter
from symattn.codegen.backends.triton.runtime import RUNTIMES
from symattn.lang.functions import TORCH, TRITON
from symattn.specs import Spec


def _render(source: str | Spec, regenerate: str, environment: jinja2.Environment, module_class: Callable) -> str:
    """``module.render_triton``, imported when called: the module prints with the torch backend's printer, whose
    package imports this one. module_class() gives the torch module's nn.Module (its constructor and weights)."""
    from symattn.codegen.backends.triton.module import render_triton

    return render_triton(source, regenerate, environment, module_class)


TRITON_BACKEND = Backend(
    name=TRITON,
    printer=TilePrinter,
    variants=("standard",),
    check_inputs="_dimensions",
    helpers=(),
    mask_shape="",
    autodiff=True,
    second_order_helpers=None,
    runtimes=RUNTIMES,
    imports=(TORCH, TRITON),
    device=True,
    missing_variant="its kernels recompute P from the row log-sum-exp: the standard module never makes P whole",
    renders=_render,
)
