"""`derive --format html`: one self-contained page (MathML, contents, marks, the dataflow), committed and rendered."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

import symattn as sa
from symattn.cli import main
from symattn.derive.formats.html import mathml, prose

DOCS = Path(__file__).resolve().parents[2] / "docs" / "derivations"
FIGURE = re.compile(r"<figure>.*?</figure>", flags=re.S)
PLACEHOLDER = "<svg>the dataflow</svg>"


@pytest.mark.parametrize("name", sa.specs())
def test_committed_html_page_is_what_the_tool_writes(name, derivations):
    # the embedded picture comes from Graphviz (its bytes vary by version): compared apart from the page
    path = DOCS / f"{name}.html"
    regenerate = f"symattn derive {name} --format html > docs/derivations/{name}.html"
    assert path.exists(), f"missing {path}; write it with: {regenerate}"
    committed = path.read_text(encoding="utf-8")
    figure = FIGURE.search(committed)
    assert figure and "<svg" in figure.group(0), f"{path} has no dataflow picture; {regenerate} (needs graphviz)"
    expected = derivations[name].html(figure=PLACEHOLDER)
    assert FIGURE.sub(f"<figure>{PLACEHOLDER}</figure>", committed) == expected, f"{path} is stale; {regenerate}"


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed (Debian: graphviz)")
@pytest.mark.parametrize("name", sa.specs())
def test_committed_dataflow_picture_says_what_the_tool_draws(name):
    """The picture's words (values, shapes, FLOPs) as Graphviz draws them now: its layout bytes vary by version."""
    from symattn.cli import _figure

    words = re.compile(r"<text[^>]*>(.*?)</text>", flags=re.S)
    committed = FIGURE.search((DOCS / f"{name}.html").read_text(encoding="utf-8")).group(0)
    fresh = _figure(sa.spec(name))
    regenerate = f"symattn derive {name} --format html > docs/derivations/{name}.html"
    assert sorted(words.findall(committed)) == sorted(words.findall(fresh)), f"the figure is stale; {regenerate}"


def test_page_is_self_contained_with_contents_and_marks(derivations):
    page = derivations["attention"].html()
    assert "http://" not in page.replace("http://www.w3.org/", "") and "https://" not in page  # nothing fetched
    assert "<script src" not in page and "<link" not in page
    for target in ("Q", "K", "V"):
        assert f'<a href="#grad-{target}">∂f/∂{target}</a>' in page and f'id="grad-{target}"' in page
    assert page.count('<td class="mark ok">✓</td>') == 37 - 3 * 2  # each line once: df's two checks, the result's two
    assert "product rule" in page and "cyclic property of the trace" in page
    assert "Verified: all 37 equalities agree" in page


def test_math_is_mathml_with_upright_names():
    out = mathml(r"\operatorname{tr}\left(\bar{P}^{T} \mathrm{d}P\right)")
    assert out.startswith("<math") and '<mi mathvariant="normal">tr</mi>' in out
    assert '<mi mathvariant="normal">d</mi>' in out and "<mo>tr</mo>" not in out
    text = prose(r"Here $x$ and \texttt{a<b}.")
    assert text.startswith("Here <math") and text.endswith("and <code>a&lt;b</code>.")


def test_cli_html_embeds_the_picture(capsys, monkeypatch):
    assert main(["derive", "attention", "--wrt", "V", "--format", "html"]) == 0
    page = capsys.readouterr().out
    assert page.startswith("<!DOCTYPE html>") and ("<figure><svg" in page) == (shutil.which("dot") is not None)
    monkeypatch.setattr(shutil, "which", lambda name: None)  # no Graphviz: the page without the picture
    assert main(["derive", "attention", "--wrt", "V", "--format", "html"]) == 0
    assert "<figure>" not in capsys.readouterr().out


@pytest.mark.slow  # a browser
@pytest.mark.skipif(shutil.which("chromium") is None, reason="Chromium is not installed (Debian: chromium)")
def test_headless_chromium_lays_out_every_formula(tmp_path):
    page = tmp_path / "mha.html"
    shutil.copy(DOCS / "mha.html", page)
    browser = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    browser.append("--virtual-time-budget=10000")  # let the page's load handler run
    dom = subprocess.run(
        [*browser, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=180, check=False
    ).stdout
    # the page's own script: every <math> has a size, none failed to convert, no script error
    assert re.search(r'data-render="ok: \d{3,} math elements"', dom), re.findall(r'data-render="[^"]*"', dom)
    shot = tmp_path / "mha.png"
    subprocess.run(
        [*browser, "--window-size=1200,1600", f"--screenshot={shot}", page.as_uri()],
        capture_output=True,
        timeout=180,
        check=False,
        cwd=tmp_path,
    )
    data = shot.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 50_000  # a blank page compresses to a few kB
