"""Long LaTeX equalities broken to fit a page: a width estimate and a greedy line breaker.

The printer marks with ``BREAK`` each place a line may break (before a binary operator,
between the factors of a product; parentheses are plain, so a break may fall inside
them). ``width`` estimates how wide TeX sets a math string at 10 pt (a little wide, so
that a line it accepts fits); ``break_lines`` fills each line up to a budget and
starts the next before the operator where the budget would be passed.
"""

from __future__ import annotations

from symattn.derive.formats.latex import BREAK

# points at 10 pt; binary operators and relations include the spaces TeX puts around them
CHAR = 5.6  # a lower-case letter, a digit
UPPER = 8.2  # a capital in math italic (with its italic correction)
BINARY = 12.5  # +, −, ⊙ with \medmuskip either side
RELATION = 14.5  # =, := with \thickmuskip
COMMANDS = {
    ",": 1.7,
    ";": 2.8,
    " ": 3.4,
    "quad": 10.0,
    "qquad": 20.0,
    "odot": BINARY,
    "circ": 5.0,
    "sum": 14.0,
    "partial": 6.0,
    "exp": 3 * CHAR,
    "log": 3 * CHAR,
    "tanh": 4 * CHAR,
    "sigma": CHAR,
    "gamma": CHAR,
    "beta": CHAR,
    "left": 0.0,
    "right": 0.0,
    "bigl": 0.0,
    "bigr": 0.0,
}
GROUP_SCALE = {  # commands whose width is that of their {argument}, times a factor
    "operatorname": 0.95,
    "mathrm": 0.95,
    "mathbf": 1.0,
    "text": 0.9,
    "texttt": 0.95,
    "bar": 1.0,
    "hat": 1.0,
    "mathbb": 1.0,
}
SCRIPT = 0.72  # superscripts and subscripts


def _glyph(ch: str) -> float:
    """A math italic letter or a digit: capitals are the widest."""
    return UPPER if ch.isupper() else CHAR


def width(math: str) -> float:
    """The width in points that TeX (10 pt, display style) gives the math string, estimated generously."""
    total, _ = _width(math.replace(BREAK, ""), 0)
    return total


def _group(s: str, i: int) -> tuple[float, int]:
    """The width of the {group} or single token at s[i], and the index after it."""
    while i < len(s) and s[i] == " ":
        i += 1
    if i < len(s) and s[i] == "{":
        return _width(s, i + 1, closing=True)
    if i < len(s) and s[i] == "\\":
        return _command(s, i)
    return (_glyph(s[i]) if i < len(s) else 0.0), i + 1


def _command(s: str, i: int) -> tuple[float, int]:
    """The width of the command at s[i] == '\\' (with its arguments), and the index after it."""
    j = i + 1
    while j < len(s) and s[j].isalpha():
        j += 1
    name = s[i + 1 : j] if j > i + 1 else s[i + 1 : i + 2]
    j = max(j, i + 2)
    if name in GROUP_SCALE:
        w, j = _group(s, j)
        return GROUP_SCALE[name] * w, j
    if name in ("frac", "tfrac", "dfrac"):
        top, j = _group(s, j)
        bottom, j = _group(s, j)
        return max(top, bottom) * (SCRIPT if name == "tfrac" else 1.0) + 2.0, j
    if name == "sqrt":
        w, j = _group(s, j)
        return w + 8.0, j
    return COMMANDS.get(name, CHAR), j


def _width(s: str, i: int, closing: bool = False) -> tuple[float, int]:
    total = 0.0
    while i < len(s):
        ch = s[i]
        if ch == "}" and closing:
            return total, i + 1
        if ch == "\\":
            w, i = _command(s, i)
        elif ch in "^_":
            w, i = _group(s, i + 1)
            w *= SCRIPT
        elif ch == "{":
            w, i = _width(s, i + 1, closing=True)
        elif ch in "+-":
            w, i = BINARY, i + 1
        elif ch == "=":
            w, i = RELATION, i + 1
        elif ch in " &":
            w, i = 0.0, i + 1
        elif ch in "()[]":
            w, i = 3.9, i + 1
        else:
            w, i = _glyph(ch), i + 1
        total += w
    return total, i


def break_lines(math: str, budget: float, first: float | None = None) -> list[str]:
    """math cut at its BREAK marks into lines of at most budget points (the first line: first).

    A mark inside braces is never a break (a {group} must stay on one line); a piece wider
    than the budget stays whole on its own line.
    """
    pieces, depth, start = [], 0, 0
    for k, ch in enumerate(math):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif ch == BREAK and depth == 0:
            pieces.append(math[start:k])
            start = k + 1
    pieces.append(math[start:])
    lines: list[str] = []
    line = ""
    for piece in pieces:
        limit = budget if lines else (first if first is not None else budget)
        if line and width(line + piece) > limit:
            lines.append(line.rstrip())
            line = piece.lstrip()
        else:
            line += piece
    lines.append(line.rstrip())
    return [text.replace(BREAK, "") for text in lines]


__all__ = ["break_lines", "width"]
