"""Line layout of generated code: signatures, calls and literals broken over lines as ruff format would.

The generated modules are committed and kept ruff-format clean without running ruff:
a line that fits in 120 columns stays whole; otherwise its bracketed items go on one
indented line when they fit there, else one item a line with a trailing comma.
"""

from __future__ import annotations

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
    return wrapped(f"{target} = ", items, "", indent, brackets="()")


def checked_inputs(inputs: tuple, function: str) -> str:
    """A, B, … = function({"A": A, …}), broken over lines as ruff format would."""
    names = [str(x.name) for x in inputs]
    items = [f'"{name}": {name}' for name in names]
    targets = f"({names[0]},)" if len(names) == 1 else ", ".join(names)  # one input: unpack the list of one
    prefix = f"{targets} = {function}("
    one = "{" + ", ".join(items) + "}"
    if 4 + len(prefix) + len(one) + 1 <= WIDTH:
        return f"{prefix}{one})"
    if 8 + len(one) <= WIDTH:
        return f"{prefix}\n        {one}\n    )"
    body = "".join(f"            {item},\n" for item in items)
    return f"{prefix}\n        {{\n{body}        }}\n    )"


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
