"""MkDocs hook: the derivation pages' LaTeX as MathML, at build time (no script, no network).

`symattn derive --format markdown` writes `$…$` and `$$\\begin{aligned}…\\end{aligned}$$`; the site shows
them as MathML made by latex2mathml, as `symattn derive --format html` does. latex2mathml has no
`aligned`, so each row becomes a row of an <mtable>, its `&`-separated cells converted one by one.
Formulas are swapped for placeholders before Markdown runs (so `*` and `_` inside them stay math) and put
back into the rendered HTML.
"""

from __future__ import annotations

import re

from latex2mathml.converter import convert

DISPLAY = re.compile(r"^\$\$\n(.*?)\n\$\$$", re.S | re.M)
INLINE = re.compile(r"(?<![\\$])\$([^$\n]+)\$")
HEADING = re.compile(r"^(#+ .*?)\$([^$\n]+)\$", re.M)
TEXTTT = re.compile(r"\\texttt\{([^}]*)\}")
ALIGNED = re.compile(r"^\\begin\{aligned\}\n(.*)\n\\end\{aligned\}$", re.S)
MATH_TAG = re.compile(r"^<math[^>]*>(.*)</math>$", re.S)
UPRIGHT_OPERATOR = re.compile(r"<mo>([A-Za-z]+)</mo>")
PLACEHOLDER = "SYMATTNMATH{:05d}X"
PARAGRAPH = re.compile(r"<p>(SYMATTNMATH\d{5}X)</p>")
TOKEN = re.compile(r"SYMATTNMATH\d{5}X")


def _inner(latex: str) -> str:
    """One formula's MathML without its <math> element (upright names as identifiers, as derive.formats.html)."""
    latex = latex.replace(r"\mathrm{d}", r"\operatorname{d}")
    out = UPRIGHT_OPERATOR.sub(r'<mi mathvariant="normal">\1</mi>', convert(latex))
    return MATH_TAG.match(out).group(1)


def _display(latex: str) -> str:
    aligned = ALIGNED.match(latex.strip())
    if aligned is None:
        return f'<math display="block">{_inner(latex)}</math>'
    rows = []
    for row in re.split(r"\\\\\s*\n", aligned.group(1)):
        cells = "".join(f"<mtd>{_inner(cell) if cell.strip() else ''}</mtd>" for cell in row.split("&"))
        rows.append(f"<mtr>{cells}</mtr>")
    table = '<mtable columnalign="right left right left" displaystyle="true">' + "".join(rows) + "</mtable>"
    return f'<div class="symattn-math"><math display="block">{table}</math></div>'


def _plain(latex: str) -> str:
    """A heading's formula as text (headings also go into the table of contents, which is plain text)."""
    for command, letter in (("\\partial ", "∂"), ("\\beta", "β"), ("\\gamma", "γ")):
        latex = latex.replace(command, letter)
    return re.sub(r"([_^])\{([^}]*)\}", r"\1\2", latex)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if not page.file.src_uri.startswith("derivations/"):
        return markdown
    formulas: list[str] = []

    def stash(html: str) -> str:
        formulas.append(html)
        return PLACEHOLDER.format(len(formulas) - 1)

    markdown = HEADING.sub(lambda m: m.group(1) + _plain(m.group(2)), markdown)
    markdown = DISPLAY.sub(lambda m: "\n" + stash(_display(m.group(1))) + "\n", markdown)
    markdown = INLINE.sub(lambda m: stash(f"<math>{_inner(m.group(1))}</math>"), markdown)
    markdown = TEXTTT.sub(r"`\1`", markdown)
    page.meta["symattn_math"] = formulas
    return markdown


def on_page_content(html: str, page, config, files) -> str:
    formulas = page.meta.get("symattn_math")
    if not formulas:
        return html
    html = PARAGRAPH.sub(lambda m: formulas[int(m.group(1)[11:16])], html)
    return TOKEN.sub(lambda m: formulas[int(m.group(0)[11:16])], html)
