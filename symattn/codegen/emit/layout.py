"""Line layout of generated code: signatures, calls and literals broken over lines as ruff format would.

The generated modules are committed and kept ruff-format clean without running ruff:
a line that fits in 120 columns stays whole; otherwise its bracketed items go on one
indented line when they fit there, else one item a line with a trailing comma.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

WIDTH = 120


def call(function: str, arguments: list[str], indent: int) -> str:
    """return function(arguments), broken over lines as ruff format would when it is too long."""
    line = f"return {function}({', '.join(arguments)})"
    if indent + len(line) <= WIDTH:
        return line
    if indent + 4 + len(", ".join(arguments)) <= WIDTH:
        return f"return {function}(\n{' ' * (indent + 4)}{', '.join(arguments)}\n{' ' * indent})"
    body = "".join(f"{' ' * (indent + 4)}{a},\n" for a in arguments)
    return f"return {function}(\n{body}{' ' * indent})"


def wrapped(prefix: str, items: list[str], close: str, indent: int, brackets: str = "") -> str:
    """prefix + items + close on one line, or broken over lines as ruff format would (items one a line)."""
    opening, closing = brackets[:1], brackets[1:]
    line = f"{prefix}{opening}{', '.join(items)}{closing}{close}"
    if indent + len(line) <= WIDTH:
        return line
    if not opening:
        opening, closing = "(", ")"
    if indent + 4 + len(", ".join(items)) <= WIDTH:
        return f"{prefix}{opening}\n{' ' * (indent + 4)}{', '.join(items)}\n{' ' * indent}{closing}{close}"
    body = "".join(f"{' ' * (indent + 4)}{item},\n" for item in items)
    return f"{prefix}{opening}\n{body}{' ' * indent}{closing}{close}"


def statement(function: str, arguments: list[str], indent: int) -> str:
    """function(arguments) as a statement, broken over lines as ruff format would; an argument may span lines
    (laid out for indent + 4)."""
    flat = all("\n" not in a for a in arguments)
    line = f"{function}({', '.join(arguments)})"
    if flat and indent + len(line) <= WIDTH:
        return line
    if flat and indent + 4 + len(", ".join(arguments)) <= WIDTH:
        return f"{function}(\n{' ' * (indent + 4)}{', '.join(arguments)}\n{' ' * indent})"
    body = "".join(f"{' ' * (indent + 4)}{a},\n" for a in arguments)
    return f"{function}(\n{body}{' ' * indent})"


def assign_tuple(target: str, items: list[str], indent: int) -> str:
    """target = (items), a tuple even of one item, broken over lines as ruff format would."""
    if len(items) == 1:
        return f"{target} = ({items[0]},)"
    line = f"{target} = ({', '.join(items)})"
    if indent + len(line) <= WIDTH:
        return line
    body = "".join(f"{' ' * (indent + 4)}{item},\n" for item in items)  # a tuple literal that breaks: one a line
    return f"{target} = (\n{body}{' ' * indent})"


def unpacked(names: list[str], value: str, indent: int) -> str:
    """A, B, … = value (one name: (A,) = value), the targets in brackets one a line when too long."""
    targets = f"({names[0]},)" if len(names) == 1 else ", ".join(names)
    if indent + len(f"{targets} = {value}") <= WIDTH:
        return f"{targets} = {value}"
    body = "".join(f"{' ' * (indent + 4)}{name},\n" for name in names)
    return f"(\n{body}{' ' * indent}) = {value}"


def deleted(names: Sequence[str], indent: int) -> str:
    """del names, broken over lines as ruff format would (in brackets, one a line)."""
    line = f"del {', '.join(names)}"
    if indent + len(line) <= WIDTH:
        return line
    body = "".join(f"{' ' * (indent + 4)}{name},\n" for name in names)
    return f"del (\n{body}{' ' * indent})"


def given_flags(names: list[str], indent: int) -> str:
    """ctx.given = [x is not None for x in (names)], broken over lines as ruff format would."""
    items = ", ".join(names) + ("," if len(names) == 1 else "")
    line = f"ctx.given = [x is not None for x in ({items})]"
    if indent + len(line) <= WIDTH:
        return line
    inner, pad = " " * (indent + 4), " " * indent
    if indent + 4 + len(line) - len("ctx.given = []") <= WIDTH:
        return f"ctx.given = [\n{inner}x is not None for x in ({items})\n{pad}]"
    rows = "".join(f"{inner}    {name},\n" for name in names)  # a tuple literal that breaks: one item a line
    return f"ctx.given = [\n{inner}x is not None\n{inner}for x in (\n{rows}{inner})\n{pad}]"


def checked_inputs(inputs: tuple, function: str) -> str:
    """A, B, … = function({"A": A, …}), broken over lines as ruff format would.

    Targets too many for the line with ``= function(`` go in brackets, one a line, before ``) = function(``.
    """
    names = [str(x.name) for x in inputs]
    items = [f'"{name}": {name}' for name in names]
    targets = f"({names[0]},)" if len(names) == 1 else ", ".join(names)  # one input: unpack the list of one
    prefix = f"{targets} = {function}("
    if 4 + len(prefix) > WIDTH:
        prefix = "(\n" + "".join(f"        {name},\n" for name in names) + f"    ) = {function}("
    last = len(prefix.rsplit("\n", 1)[-1]) if "\n" in prefix else 4 + len(prefix)  # columns of its last line
    one = "{" + ", ".join(items) + "}"
    if last + len(one) + 1 <= WIDTH:
        return f"{prefix}{one})"
    if 8 + len(one) <= WIDTH:
        return f"{prefix}\n        {one}\n    )"
    body = "".join(f"            {item},\n" for item in items)
    return f"{prefix}\n        {{\n{body}        }}\n    )"


def top_level_terms(value: str) -> list[str]:
    """value split before each + or − outside brackets (the first term, then "+ b", "- c", …)."""
    terms, depth, start = [], 0, 0
    for i, ch in enumerate(value):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if depth == 0 and value[i : i + 3] in (" + ", " - ") and i > start:
            terms.append(value[start:i].strip())
            start = i + 1
    return [*terms, value[start:].strip()]


def _groups(value: str) -> list[tuple[int, int]]:
    """The (opening, closing) positions of value's outermost bracket pairs, left to right."""
    groups, depth, opening = [], 0, 0
    for i, ch in enumerate(value):
        if ch in "([{":
            opening = i if depth == 0 else opening
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                groups.append((opening, i))
    return groups


def _inside(text: str, indent: int) -> str:
    """Bracketed content at indent: one line when it fits, else one term a line, each before its + or −."""
    if indent + len(text) <= WIDTH:
        return " " * indent + text
    return "\n".join(" " * indent + term for term in top_level_terms(text))


def assigned(target: str, value: str, indent: int) -> str:
    """The value of ``target = value`` broken over lines as ruff format would, when the line is too long.

    - a sum of several + or −: in brackets, whole on their own line or one term a line;
    - a sum of two terms that starts or ends with a bracket: kept on the line, the first bracket pair
      that overflows broken instead (ruff's optional parentheses omitted);
    - a call f(…): its arguments on their own line(s).
    """
    if indent + len(target) + 3 + len(value) <= WIDTH or "\n" in value:
        return value
    pad, terms, groups = " " * indent, top_level_terms(value), _groups(value)
    if len(terms) == 1 and groups and groups[-1][1] == len(value) - 1 and groups[-1][0] > 0:  # f(args), f(…)[…]
        # the last bracket pair broken, or, as ruff omits a trailer, the call before a subscript (f(…)[..., None])
        # when breaking the subscript would leave the first line too long
        k, head = len(groups) - 1, indent + len(target) + 3
        while k > 0 and head + groups[k][0] + 1 > WIDTH and groups[k - 1][1] == groups[k][0] - 1:
            k -= 1
        opening, closing = groups[k]
        return f"{value[: opening + 1]}\n{_inside(value[opening + 1 : closing], indent + 4)}\n{pad}{value[closing:]}"
    if len(terms) == 2 and groups and (groups[0][0] == 0 or groups[-1][1] == len(value) - 1):
        out, column, position = [], indent + len(target) + 3, 0
        for k, (opening, closing) in enumerate(groups):
            upto = groups[k + 1][0] + 1 if k + 1 < len(groups) else len(value)  # flat until the next break
            if column + upto - position <= WIDTH:
                continue
            out.append(f"{value[position : opening + 1]}\n{_inside(value[opening + 1 : closing], indent + 4)}\n{pad}")
            column, position = indent, closing
        return "".join(out) + value[position:]
    if len(terms) == 1:
        return value
    return f"(\n{_inside(value, indent + 4)}\n{pad})"


def flattened(value: str) -> str:
    """A value ``assigned`` broke over lines, on one line again (the brackets it put around a broken sum dropped)."""
    if "\n" not in value:
        return value
    groups = _groups(value)
    whole = value.startswith("(\n") and bool(groups) and groups[0] == (0, len(value.rstrip()) - 1)
    text = re.sub(r"\(\n\s*", "(", value)
    text = re.sub(r"\n\s*\)", ")", text)
    text = re.sub(r"\n\s*", " ", text)
    return text[1:-1] if whole else text


def shifted(text: str, by: int) -> str:
    """text with its continuation lines by columns to the left: a statement broken for a column a block deeper than
    the template writes it, whose lines the template then indents (Jinja's indent filter)."""
    first, *rest = text.split("\n")
    return "\n".join([first, *(line[by:] if line[:by].isspace() else line for line in rest)])


def module_doc(spec_name: str, weights: list[str]) -> str:
    """The nn.Module's one-line docstring, naming its weights where the line has room."""
    if not weights:
        return f"{spec_name} as a module."
    line = f"{spec_name} as a module holding the weights {', '.join(weights)}."
    return line if len(line) <= 110 else f"{spec_name} as a module holding its {len(weights)} weights and biases."


def define(head: str, parameters: list[str], indent: int) -> str:
    """def head(parameters):, broken over lines as ruff format would when it is too long."""
    line = f"def {head}({', '.join(parameters)}):"
    if indent + len(line) <= WIDTH:
        return line
    inner = ", ".join(parameters)
    if indent + 4 + len(inner) <= WIDTH:
        return f"def {head}(\n{' ' * (indent + 4)}{inner}\n{' ' * indent}):"
    body = "".join(f"{' ' * (indent + 4)}{p},\n" for p in parameters)
    return f"def {head}(\n{body}{' ' * indent}):"
