"""A derivation as one self-contained HTML page: MathML, a table of contents, a mark per line.

The page holds everything it shows (no script, font or style sheet from the network):
the forward pass, the notation, then for each target its rows ``Document.lines`` (left
side, = or :=, right side, the rule) each marked ✓ or with its discrepancy
(``symattn.derive.formats.marks``), and ∂f/∂W named and in closed form. The LaTeX of
``symattn.derive.formats.latex`` becomes MathML through ``latex2mathml``; browsers lay MathML
out themselves. A caller may pass a figure (inline SVG, the dataflow picture of
``symattn graph``). A short inline script sets ``data-render`` on the page to ``ok: N
math elements`` once every formula has a size, or to the error it met.
"""

from __future__ import annotations

import html
import re
from collections.abc import Sequence

from latex2mathml.converter import convert
from sympy import Basic

from symattn.derive.formats.document import NOT_WRITTEN_OUT, SWEEP_TITLE, Document, sections
from symattn.derive.formats.marks import mark, row_checks
from symattn.derive.step_check import Check
from symattn.derive.steps import Chain
from symattn.specs import Spec

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 2em auto;
       max-width: 72em; padding: 0 1.5em; color: #1d1d1f; line-height: 1.45; }
math { font-family: "STIX Two Math", "Latin Modern Math", "Cambria Math", math; font-size: 1.1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd; }
nav ol { columns: 3; } .summary { color: #333; } .summary.fail { color: #b00020; font-weight: bold; }
.scroll { overflow-x: auto; }
table.steps { border-collapse: collapse; } table.steps td { padding: 0.25em 0.4em; vertical-align: middle; }
td.mark { font-weight: bold; white-space: nowrap; } td.mark.ok { color: #1a7f37; } td.mark.fail { color: #b00020; }
td.left { text-align: right; } td.rel { text-align: center; } td.reason { color: #555; font-size: 0.9em; }
tr.definition td { background: #f6f8fa; } tr.result td { border-top: 1px solid #ccc; }
figure { margin: 1em 0; } figure svg { max-width: 100%; height: auto; }
"""

# sets data-render on <html>: "ok: N math elements", or the first error met (no MathML, a formula with no size)
SCRIPT = """
(function () {
  var root = document.documentElement;
  window.addEventListener("error", function (e) { root.dataset.render = "error: " + e.message; });
  window.addEventListener("load", function () {
    if (root.dataset.render) return;
    var maths = document.getElementsByTagName("math"), empty = 0;
    if (typeof MathMLElement === "undefined" || !(maths[0] instanceof MathMLElement)) {
      root.dataset.render = "error: this browser does not lay out MathML"; return;
    }
    for (var i = 0; i < maths.length; i++) {
      var box = maths[i].getBoundingClientRect();
      if (!(box.width > 0 && box.height > 0)) empty++;
    }
    var broken = document.getElementsByTagName("merror").length;
    root.dataset.render = broken ? "error: " + broken + " formulas did not convert"
      : empty ? "error: " + empty + " of " + maths.length + " formulas have no size"
      : "ok: " + maths.length + " math elements";
  });
})();
"""


def mathml(latex: str, display: bool = False) -> str:
    """One formula as MathML (display: its own block, limits above and below).

    Upright names (tr, softmax, Concat, the d of a differential) are identifiers, not
    operators: latex2mathml writes \\operatorname{tr} as <mo>, which browsers space as a
    binary operator, and \\mathrm{d} as an italic <mi>.
    """
    latex = latex.replace(r"\mathrm{d}", r"\operatorname{d}")
    out = convert(latex, display="block" if display else "inline")
    return UPRIGHT_OPERATOR.sub(r'<mi mathvariant="normal">\1</mi>', out)


UPRIGHT_OPERATOR = re.compile(r"<mo>([A-Za-z]+)</mo>")


TEXTTT = "\\texttt{"


def prose(text: str) -> str:
    """A paragraph of text with $…$ formulas (MathML) and \\texttt{…} (code); everything else escaped."""
    parts = re.split(r"(\$[^$]+\$|\\texttt\{[^}]*\})", text)
    out = []
    for part in parts:
        if part.startswith("$"):
            out.append(mathml(part[1:-1]))
        elif part.startswith(TEXTTT):
            out.append(f"<code>{html.escape(part[len(TEXTTT) : -1])}</code>")
        else:
            out.append(html.escape(part))
    return "".join(out)


def anchor(target: Basic | None) -> str:
    """The section's id: grad-W for ∂f/∂W, backward for a shared sweep's steps."""
    return "backward" if target is None else "grad-" + re.sub(r"[^A-Za-z0-9_-]", "-", str(target.name))


def _row(cells: Sequence[str], marked: str, kind: str = "") -> str:
    status = "" if not marked else (" ok" if marked.startswith("✓") else " fail")
    tds = [f'<td class="mark{status}">{html.escape(marked)}</td>']
    tds += [f'<td class="{cls}">{cell}</td>' for cls, cell in zip(("left", "rel", "right", "reason"), cells)]
    return f'<tr class="{kind}">' + "".join(tds) + "</tr>" if kind else "<tr>" + "".join(tds) + "</tr>"


def chain_table(doc: Document, c: Chain, checks: Sequence[Check], steps: bool, targets: Sequence[Basic]) -> str:
    """The chain's rows with their marks (if steps), then each target's ∂f/∂W named and in closed form."""
    rows = doc.lines(c)
    marks = [mark(k) for k in row_checks(c, checks)]
    out = ['<div class="scroll"><table class="steps">']
    for (left, sign, right, reason), marked in zip(rows if steps else (), marks):
        relation = mathml("=" if sign == "=" else r"\mathrel{:=}")
        kind = "definition" if sign == ":=" else ""
        cells = (mathml(left) if left else "", relation, mathml(right), html.escape(reason))
        out.append(_row(cells, marked, kind))
    for target in targets:
        head, named, closed = doc.result(c, target)
        gradient = (mathml(head), mathml("="), mathml(named), "the gradient, with the names above")
        out.append(_row(gradient, marks[len(rows) + c.targets.index(target)], "result"))
        if closed is None:
            out.append(_row(("", mathml("="), html.escape(NOT_WRITTEN_OUT), ""), "", "result"))
        elif closed != named:
            out.append(_row(("", mathml("="), mathml(closed), "the names substituted: the closed form"), "", "result"))
    out.append("</table></div>")
    return "\n".join(out)


def summary(checks: Sequence[Check]) -> tuple[str, bool]:
    """One sentence on the verification (no discrepancy printed: the page is the same on every machine)."""
    failed = [k for k in checks if not k.ok]
    if not checks:
        return "Not verified.", True
    if failed:
        return f"{len(failed)} of {len(checks)} checked equalities FAIL (marked ✗ below).", False
    exact = max((k.tolerance for k in checks if k.tolerance < 1e-6), default=0.0)
    return (
        f"Verified: all {len(checks)} equalities agree at a random float64 point, each within a relative "
        f"{exact:.0e} (df within 1e-6 of a central difference); ✓ marks each checked line.",
        True,
    )


def page(spec: Spec, chains: Sequence[Chain], checks: Sequence[Check], figure: str | None = None) -> str:
    """The HTML document: title, contents, forward pass, notation, the dataflow figure, one section per target."""
    doc = Document(spec, latex=True)
    title = f"Gradients of {spec.name}: {spec.summary}"
    sentence, ok = summary(checks)
    toc = ['<li><a href="#forward">Forward pass</a></li>']
    if figure is not None:
        toc.append('<li><a href="#dataflow">Dataflow</a></li>')
    parts = [(c, *section) for c in chains for section in sections(c)]
    toc += [f'<li><a href="#{anchor(t)}">{html.escape(_toc_entry(t))}</a></li>' for _, t, _, _ in parts]
    out = [
        "<!DOCTYPE html>",
        '<html lang="en">',
        "<head>",
        '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        '<meta name="generator" content="symattn derive --format html (do not edit)">',
        f"<title>{html.escape(title)}</title>",
        f"<style>{STYLE}</style>",
        f"<script>{SCRIPT}</script>",
        "</head>",
        "<body>",
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="summary{"" if ok else " fail"}">{html.escape(sentence)}</p>',
        "<nav><h2>Contents</h2><ol>" + "".join(toc) + "</ol></nav>",
        '<section id="forward"><h2>Forward pass</h2>',
        '<div class="scroll"><table class="steps">',
        *(_row((mathml(name), mathml("="), mathml(value), ""), "") for name, value in doc.forward()),
        "</table></div>",
        f"<p>{prose(doc.notation())}</p>",
        "</section>",
    ]
    if figure is not None:
        out += [
            '<section id="dataflow"><h2>Dataflow</h2>',
            "<p>The generated schedule: each named value with its shape and FLOPs; a double border marks a "
            "value saved for the backward pass (<code>symattn graph SPEC --backward</code>).</p>",
            f"<figure>{figure}</figure>",
            "</section>",
        ]
    for c, target, steps, targets in parts:
        if target is None:
            heading = html.escape(SWEEP_TITLE)
        else:
            heading = f"{mathml(doc.head(target))} <small>({html.escape(str(target.name))})</small>"
        out += [
            f'<section id="{anchor(target)}"><h2>{heading}</h2>',
            chain_table(doc, c, checks, steps, targets),
            "</section>",
        ]
    out += ["</body>", "</html>", ""]
    return "\n".join(out)


def _toc_entry(target: Basic | None) -> str:
    return SWEEP_TITLE if target is None else f"∂f/∂{target.name}"


def inline_svg(svg: str) -> str:
    """An SVG file's markup without its XML declaration, doctype and comments, to sit inside HTML."""
    svg = re.sub(r"<\?xml[^>]*\?>|<!DOCTYPE[^>]*>|<!--.*?-->", "", svg, flags=re.S)
    return svg.strip()


__all__ = ["inline_svg", "mathml", "page", "prose"]
