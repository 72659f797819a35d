"""Triton code of the core's entrywise steps: A = E(S) (forward), and from the library's own differentials the
backward's dS = G ⊙ ∂A/∂S, each n × m input's dB = G ⊙ ∂A/∂B and each trainable scalar's ∂A/∂τ.

For an entrywise A the Jacobian with respect to S (or B) is diagonal, so the VJP of a cotangent G equals the
forward differential along G: dS = d A[S ↦ G] (``autodiff.differentials.differential``), printed entry by entry.
A tile is a name in the kernel (``s``, ``g``, ``tile_B``); each function is its record's Triton call
(``calls[TRITON]``); a scalar that is not a number (1/√d_k, τ, scale) is a kernel argument ``c0``, ``c1``, …
whose value the module computes before the launch (``Printed.coefficients``). A matrix of positions (``sa.entries``,
whole or per head) is a tile ``pos0``, ``pos1``, … made from the tile's positions where the scores are
(``positions``): its formula printed once per distinct formula (the derivative in a learned slope is another).
Dropout's mask of the weights, Z_p (``sa.dropout(P, p)``), is made where the tile is too (``dropout_draws``).

The cheap forms (the fused-attention tutorial's and FlashAttention's): a core normalised by a row softmax (or a
log-softmax map) prints A₂ = log₂(e)·A (``in_base_2``: the factor folded into the scalar multiples, a kernel argument
or a literal), so that each weight is one exp2 (e^x = 2^(x·log₂e)) and the row statistic L₂ = log₂ Σ 2^(A₂) is
base 2 throughout its kernels; dS = c·R prints R, its scalar c applied once to dQ and dK (``scalar_factor``); each
function call is printed once per tile as a named line ``f0``, ``f1``, … that A, dS and Ȧ share (``shared``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import sympy as sp
from sympy import Basic, MatrixExpr, MatrixSymbol
from sympy.matrices.expressions import HadamardPower, HadamardProduct, MatAdd, MatMul, OneMatrix, ZeroMatrix
from sympy.matrices.expressions.matexpr import MatrixElement

from symattn.autodiff.differentials import differential
from symattn.codegen.backends.triton.core import Core
from symattn.codegen.backends.triton.positions import (
    TileWindow,
    block_map_formula,
    formula_code,
    head_code,
    masks_of,
    tile_formula,
    tile_window,
)
from symattn.errors import SymattnError
from symattn.lang.functions import TORCH, TRITON, Elementwise
from symattn.lang.graph import postorder
from symattn.lang.ops import SplitHeads
from symattn.lang.piecewise import literal
from symattn.lang.positions import Entries
from symattn.optimize.mask_structure import unmasked

GRADIENT = "g"  # the kernels' name of the cotangent tile G = ∂f/∂A
SCORES = "s"  # … and of the raw scores tile S = Q Kᵀ
SCORES_TANGENT = "s_dot"  # … and of its tangent Ṡ = Q̇ Kᵀ + Q K̇ᵀ (the JVP kernel)
SQUARE_ROOT = {TRITON: "tl.sqrt", TORCH: "torch.sqrt"}  # the backends a tile prints in: the kernels, the eager core
BASE_2 = ("row softmax", "log-softmax")  # the normalisers whose kernels keep A and its row statistic in base 2


def tile_name(x: MatrixSymbol) -> str:
    """The kernels' name of the tile of an n × m input (B → tile_B)."""
    return f"tile_{x.name}"


def tangent_symbol(x: sp.Symbol) -> sp.Symbol:
    """The tangent τ̇ of a trainable scalar τ, a scalar argument of the JVP kernel (τ → tau_t)."""
    return sp.Symbol(f"{x}_t", real=True)


@dataclass
class TilePrinter:
    """Prints an entrywise n × m expression as one Triton expression of tiles and scalar arguments (or, backend
    TORCH, one torch expression of the same names: the eager core's)."""

    names: dict[Basic, str]
    coefficients: dict[Basic, str] = field(default_factory=dict)  # scalar expression → its argument's name
    backend: str = TRITON
    positions: dict[Basic, tuple[str, str]] = field(default_factory=dict)  # a tile's position formula → (name, code)
    heads: Basic | None = None  # H, inside split_heads (its positions read the program's head)
    head_count: str | None = None  # how the grid's head is found from bh (``positions.head_code``); None: no split
    tables: dict[Basic, str] = field(default_factory=dict)  # a table read at positions → its name (``table_read``)
    shared: dict[Basic, tuple[str, str]] | None = None  # a function call → (its line's name, its code); None: inline

    def doprint(self, expr: Basic) -> str:
        if expr in self.names:
            return self.names[expr]
        if not isinstance(expr, MatrixExpr):
            return self._scalar(expr)
        if isinstance(expr, OneMatrix):
            return "1.0"
        if isinstance(expr, ZeroMatrix):
            return "0.0"
        if isinstance(expr, MatAdd):
            return "(" + " + ".join(self.doprint(a) for a in expr.args) + ")"
        if isinstance(expr, HadamardProduct):
            return "(" + " * ".join(self.doprint(a) for a in expr.args) + ")"
        if isinstance(expr, MatMul):
            coeff, mats = expr.as_coeff_matrices()
            if len(mats) != 1:
                raise SymattnError(f"the Triton kernels print no matrix product inside the scores' steps: {expr}")
            return f"({self._scalar(coeff)} * {self.doprint(mats[0])})"
        if isinstance(expr, HadamardPower):
            return self._power(self.doprint(expr.base), sp.sympify(expr.exp))
        if isinstance(expr, Entries):
            return self._positions(expr)
        if isinstance(expr, SplitHeads):
            return self._per_head(expr)
        if isinstance(expr, Elementwise):
            if self.shared is not None and expr in self.shared:
                return self.shared[expr][0]
            call = expr.call(self.backend)
            arg = self.doprint(expr.arg)
            code = call.format(arg) if "{" in call else f"{call}({arg})"
            if self.shared is None or call == "{0}":  # (the identity: nothing to share)
                return code
            self.shared[expr] = (f"f{len(self.shared)}", code)
            return self.shared[expr][0]
        raise SymattnError(f"the Triton kernels print no {type(expr).__name__} inside the scores' steps: {expr}")

    def _positions(self, entries: Entries) -> str:
        """The name of a tile of positions (``pos0``, …), its formula printed once per distinct formula."""
        formula = tile_formula(entries, self.heads)
        if formula not in self.positions:
            found = formula_code(formula, self._scalar, self.backend, tables=self.tables)
            self.positions[formula] = (f"pos{len(self.positions)}", found)
        return self.positions[formula][0]

    def _per_head(self, expr: SplitHeads) -> str:
        """Head h's block of an n × H·m matrix of positions: its tile read at the program's head."""
        read = set(self.tables)  # (the tables its positions read are no matrix split)
        if self.heads is not None or any(isinstance(x, MatrixSymbol) and x not in read for x in postorder(expr.arg)):
            raise SymattnError(f"the Triton kernels split into heads only matrices of positions, not {expr.arg}")
        count = head_code(expr.heads, self._scalar, self.backend)
        if self.head_count not in (None, count):
            raise SymattnError(
                f"the Triton kernels read positions of one head count, not {self.head_count} and {count}"
            )
        self.heads, self.head_count = expr.heads, count
        try:
            return self.doprint(expr.arg)
        finally:
            self.heads = None

    def _scalar(self, c: Basic) -> str:
        """A number as a float literal; any other scalar as a kernel argument (its value computed outside)."""
        c = sp.sympify(c)
        if c.is_number:
            return repr(float(c))
        return self.coefficients.setdefault(c, f"c{len(self.coefficients)}")

    def _power(self, base: str, k: Basic) -> str:
        """base^∘k for an integer k (a product or its inverse) or k = ±1/2 (a square root)."""
        if k.is_Integer and k != 0:
            body = " * ".join([base] * abs(int(k)))
            return f"({body})" if k > 0 else f"(1.0 / ({body}))"
        if k in (sp.Rational(1, 2), sp.Rational(-1, 2)):
            root = f"{SQUARE_ROOT[self.backend]}({base})"
            return root if k > 0 else f"(1.0 / {root})"
        raise SymattnError(f"the Triton kernels print no entrywise power {k} inside the scores' steps")


@dataclass(frozen=True)
class Printed:
    """The core's entrywise code: A, dS, each n × m input's gradient, each trainable scalar's ∂A/∂τ, and the
    scalar arguments they read (expression → name, in order)."""

    logits: str
    scores_gradient: str
    tile_gradients: dict[str, str]  # input or constant name → G ⊙ ∂A/∂B (a constant's, the mask M's, made where it
    # requires grad)
    scalar_partials: dict[str, str]  # trainable scalar name → ∂A/∂τ
    coefficients: dict[Basic, str]
    logits_tangent: str  # Ȧ = dA along Ṡ, each n × m input's tangent tile and each scalar's τ̇
    tangent_coefficients: dict[Basic, str]  # the scalar arguments Ȧ reads besides ``coefficients``
    eager_logits: str  # A in torch, of the same names: the eager core's (a second derivative's recomputation)
    positions: tuple[tuple[str, str], ...] = ()  # the tiles of positions the steps read: (name, Triton code)
    tangent_positions: tuple[tuple[str, str], ...] = ()  # … those only Ȧ reads
    eager_positions: tuple[tuple[str, str], ...] = ()  # … the eager core's, (name, torch code)
    heads: str | None = None  # H of the positions per head (the grid's head: bh mod H); None: none per head
    eager_heads: str | None = None  # … as the eager core reads it
    window: TileWindow | None = None  # the tiles each program visits (None: every tile, the mask applied on each)
    open_positions: dict[str, str] = field(default_factory=dict)  # a mask's tile → its code on a tile every row
    # sees whole (its −∞ branches dropped: no where)
    table_gradients: dict[str, tuple[tuple[str, str], ...]] = field(default_factory=dict)  # a learned table's name →
    # per read b[r, c]: (its flat index r·cols + c as an int tile, G ⊙ ∂A/∂b[r, c])
    gradient_positions: tuple[tuple[str, str], ...] = ()  # the tiles of positions only those read
    block_map: Basic | None = None  # the formula whose block test classes the tiles per call (None: no block map)
    scores_scale: str | None = None  # c of dS = c·R (``scores_gradient`` prints R), applied once to dQ, dK; None: 1
    scores_kept: bool = True  # does dS need the mask's where? (False: 0 wherever G is, ``zero_with``, and G is 0
    # where masked)
    tiles_kept: frozenset[str] = frozenset()  # the n × m inputs whose gradient tile needs the mask's where
    logits_lines: tuple[str, ...] = ()  # the shared function calls A reads (``name = code``), before A
    gradient_lines: tuple[str, ...] = ()  # … those only dS, the n × m inputs' gradients and ∂A/∂τ read, before dS
    tangent_lines: tuple[str, ...] = ()  # … those only Ȧ reads, before Ȧ


def print_core(core: Core, constants: frozenset[str]) -> Printed:
    """The Triton expressions of the core's steps, the tile names ``s``, ``g`` and ``tile_<name>``."""
    g = MatrixSymbol("_G", *core.scores.shape)
    names = {core.scores: SCORES, g: GRADIENT, **{t: tile_name(t) for t in core.tiles}}
    tables = {t: str(t.name) for t in core.tables}
    printer = TilePrinter(names, tables=tables, shared={})
    logits = printer.doprint(in_base_2(core.logits) if core.normaliser in BASE_2 else core.logits)
    after_logits = dict(printer.shared)
    scale, rest = scalar_factor(differential(core.logits, {core.scores: g}))
    scores_gradient = _printed(printer, rest)
    scores_scale = None if scale == 1 else printer._scalar(scale)
    moved = {str(t.name): differential(core.logits, {t: g}) for t in core.tiles}
    tiles = {name: _printed(printer, d) for name, d in moved.items()}
    scalars = {str(x): _printed(printer, differential(core.logits, {x: sp.Integer(1)})) for x in core.scalars}
    learned = [t for t in core.tables if str(t.name) not in constants]
    # the tables' gradients: tiles of positions of their own (the backward's query part alone reads them), their
    # scalar arguments the kernels' (the same dict)
    weigher = TilePrinter(names, printer.coefficients, positions=dict(printer.positions), tables=tables)
    weigher.head_count = printer.head_count
    table_gradients = {str(t.name): table_weights(weigher, core.logits, t) for t in learned}
    forward = dict(printer.coefficients)
    moving = [t for t in core.tiles if str(t.name) not in constants]
    tangents = {t: MatrixSymbol(f"_{t.name}_t", *t.shape) for t in (*moving, *learned)}
    s_t = MatrixSymbol("_S_t", *core.scores.shape)
    tangent_names = {**names, s_t: SCORES_TANGENT, **{d: tangent_tile_name(t) for t, d in tangents.items()}}
    tangent_tables = tables | {tangents[t]: f"{t.name}_dot" for t in learned}
    tangent_printer = TilePrinter(
        tangent_names, dict(forward), positions=dict(weigher.positions), tables=tangent_tables
    )
    tangent_printer.shared = dict(after_logits)  # Ȧ shares A's calls (the JVP's tile computes A first)
    tangent_printer.head_count = printer.head_count
    directions = {core.scores: s_t, **tangents, **{x: tangent_symbol(x) for x in core.scalars}}
    logits_tangent = _printed(tangent_printer, differential(core.logits, directions))
    extra = {c: name for c, name in tangent_printer.coefficients.items() if c not in forward}
    eager = TilePrinter(names, dict(forward), TORCH, tables=tables)
    eager_logits = eager.doprint(core.logits)
    masks = masks_of(core.logits, core.normaliser)
    block_map = block_map_formula(masks, core.scores.shape)
    window = tile_window(masks, core.scores.shape, block_map is not None)
    # the masks' code on the tiles every row sees whole (the window's open ones, the map's full ones)
    opened = {**printer.positions, **tangent_printer.positions} if window or block_map is not None else {}
    open_positions = {
        name: formula_code(unmasked(f), printer._scalar, TRITON, tables=tangent_tables)
        for f, (name, _) in opened.items()
        if f in masks
    }
    return Printed(
        logits,
        scores_gradient,
        tiles,
        scalars,
        forward,
        logits_tangent,
        extra,
        eager_logits,
        tuple(printer.positions.values()),
        tuple(p for f, p in tangent_printer.positions.items() if f not in weigher.positions),
        tuple(eager.positions.values()),
        tangent_printer.head_count,
        eager.head_count,
        window,
        open_positions,
        table_gradients,
        tuple(p for f, p in weigher.positions.items() if f not in printer.positions),
        block_map,
        scores_scale,
        not zero_with(rest, g, core.scores),  # (G is 0 where masked: P ⊙ (dP − D), or the mask's where on it)
        frozenset(name for name, d in moved.items() if not zero_with(scalar_factor(d)[1], g, core.scores)),
        *(_lines(found, after_logits) for found in (after_logits, printer.shared, tangent_printer.shared)),
    )


def _lines(shared: dict[Basic, tuple[str, str]], before: dict[Basic, tuple[str, str]]) -> tuple[str, ...]:
    """The shared calls' lines, name = code, in the order they were named (a call's arguments' first); only those
    not already in before, unless shared is before itself."""
    return tuple(f"{name} = {code}" for x, (name, code) in shared.items() if shared is before or x not in before)


def in_base_2(logits: MatrixExpr) -> MatrixExpr:
    """A₂ = log₂(e)·A = A / ln 2, the factor pushed into each term of a sum, onto a scalar multiple's scalar and into
    a Hadamard product's first factor, so that it folds into a coefficient where there is one (c·S ↦ (c/ln 2)·S)."""
    return _scaled(logits, 1 / sp.log(2))


def _scaled(expr: MatrixExpr, k: Basic) -> MatrixExpr:
    """k·expr with k pushed inward (``in_base_2``)."""
    if isinstance(expr, MatAdd):
        return MatAdd(*(_scaled(a, k) for a in expr.args))
    if isinstance(expr, HadamardProduct):
        return HadamardProduct(_scaled(expr.args[0], k), *expr.args[1:])
    if isinstance(expr, MatMul):
        coeff, mats = expr.as_coeff_matrices()
        if len(mats) == 1:
            return MatMul(k * coeff, mats[0])
    return MatMul(k, expr)


def scalar_factor(expr: Basic | None) -> tuple[Basic, Basic | None]:
    """(c, R) with expr = c·R, c the product of the scalars multiplying expr and its Hadamard product's factors
    (c·(a·X ⊙ Y) = (c·a)·(X ⊙ Y)); (1, expr) where there are none."""
    if isinstance(expr, MatMul):
        coeff, mats = expr.as_coeff_matrices()
        if len(mats) == 1:
            inner, rest = scalar_factor(mats[0])
            return coeff * inner, rest
    if isinstance(expr, HadamardProduct):
        found = [scalar_factor(a) for a in expr.args]
        return sp.Mul(*(c for c, _ in found)), HadamardProduct(*(r for _, r in found))
    return sp.Integer(1), expr


def zero_with(expr: Basic | None, g: MatrixSymbol, scores: MatrixSymbol) -> bool:
    """Is expr (an entrywise matrix in the cotangent G and the scores S) zero wherever G is, at any finite S? True
    where it is G ⊙ J with J finite at every finite S: J reads no other matrix (an input's tile may hold −∞ where
    the mask hides it, a matrix of positions −∞ outside n × m), only sums, products, positive integer powers and
    functions finite at every finite argument (their records' ``finite``); a 0 × finite is 0."""
    if expr is None:
        return True
    factors = expr.args if isinstance(expr, HadamardProduct) else (expr,)
    if g not in factors:
        return False
    for x in postorder(expr):
        if isinstance(x, MatrixSymbol):
            fine = x in (g, scores)
        elif isinstance(x, Elementwise):
            fine = x.finite
        elif isinstance(x, HadamardPower):
            fine = sp.sympify(x.exp).is_Integer and x.exp > 0
        else:
            fine = not isinstance(x, MatrixExpr) or isinstance(x, (MatAdd, MatMul, HadamardProduct, OneMatrix))
        if not fine:
            return False
    return True


def table_weights(printer: TilePrinter, logits: MatrixExpr, table: MatrixSymbol) -> tuple[tuple[str, str], ...]:
    """Per read b[r, c] of the table in A: (the flat index r·cols + c of each position, an int tile; the weight
    G ⊙ ∂A/∂b[r, c]), so that b̄[k] = Σ_{(i, j): index(i, j) = k} weightᵢⱼ. ∂A/∂b[r, c] is dA along a tangent ḃ with
    that read of ḃ set to 1 and every other to 0 (dA is linear in the reads); the index is a matrix of positions in
    the read's place (per head: inside its split_heads)."""
    dot = MatrixSymbol(f"_{table.name}_d", *table.shape)
    moved = differential(logits, {table: dot})
    if moved is None:
        return ()
    reads = sorted({e for e in moved.atoms(MatrixElement) if e.parent == dot}, key=sp.default_sort_key)
    found = []
    for read in reads:
        weight = moved.xreplace({e: sp.Integer(int(e == read)) for e in reads})
        row, col = read.indices
        flat = row * table.shape[1] + col  # (as the read prints it: the same rounding)
        holder = next(x for x in postorder(moved) if isinstance(x, Entries) and read in x.formula.atoms(MatrixElement))
        index = Entries(holder.rows, holder.cols, sp.Lambda(holder.lamda.variables, flat))
        split = next((x for x in postorder(moved) if isinstance(x, SplitHeads) and x.arg == holder), None)
        if flat.is_number:
            code = f"tl.full((BLOCK_M, BLOCK_N), {int(flat)}, tl.int32)"
        else:
            code = f"{printer.doprint(index if split is None else SplitHeads(index, split.heads))}.to(tl.int32)"
            if not re.search(r"\bpos_[ij]\b", code):  # an entry read at no position (g[0, h]): one per tile
                code = f"({code} + tl.zeros((BLOCK_M, BLOCK_N), tl.int32))"
        found.append((code, f"({GRADIENT} * {printer.doprint(weight)})"))
    return tuple(found)


# each score's place in its batch·head's n × m scores, flat (int64): a tile's, a transposed tile's (keys × queries)
DRAW_PLACES = {
    "tile": "bh * n * m + rows[:, None].to(tl.int64) * m + cols[None, :]",
    "transposed": "bh * n * m + rows[None, :].to(tl.int64) * m + cols[:, None]",
}


def dropout_draws(p: Basic) -> dict[str, object]:
    """Dropout's mask Z_p in the kernels: Z[bh, i, j] = 1/(1 − p) where U ≥ p, else 0, U = tl.rand(seed, place)
    uniform on [0, 1) by Philox from the call's seed and the score's flat place bh·n·m + i·m + j. A function of the
    place alone, so every kernel (forward, backward, JVP, whatever its tiling or a tile's orientation) and the flat
    run that materialises Z (a second derivative's eager core, checks) make the same draws: by key, ``places`` (the
    place's code, bound to ``at``), ``keep`` (U ≥ p at ``at``), ``scale`` (1/(1 − p)) and ``p``."""
    return {
        "places": DRAW_PLACES,
        "keep": f"tl.rand(seed, at) >= {literal(p)}",
        "scale": literal(1 / (1 - p)),
        "p": literal(p),
    }


def tangent_tile_name(x: MatrixSymbol) -> str:
    """The kernels' name of the tangent tile of an n × m input (B → tile_B_dot)."""
    return f"tile_{x.name}_dot"


def _printed(printer: TilePrinter, expr: Basic | None) -> str:
    """expr printed; 0.0 where the differential is None (A does not move)."""
    return "0.0" if expr is None else printer.doprint(expr)
