"""How the code reads (issue 59): small functions, short signatures, no private SQLAlchemy API, no measured
figures in code (they go stale; they live in docs/performance.md), and every batch statement in a .sql file."""

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "ci_cleanup"
PACKAGES = (PACKAGE, REPO / "tools" / "ci_cleanup_dev")  # the runtime and the workshop
MAX_LINES, MAX_PARAMETERS = 60, 8
# What a measurement looks like in prose: a figure with a unit of time or work, or the words of a lab notebook.
FIGURE = re.compile(r"\d[\d,.]*\s?(ms|µs|instructions)\b|callgrind|median", re.IGNORECASE)


def sources() -> list[Path]:
    return sorted(path for package in PACKAGES for path in package.rglob("*.py"))


def functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def parameters(node: ast.FunctionDef) -> int:
    args = node.args
    named = [a for a in args.posonlyargs + args.args + args.kwonlyargs if a.arg not in ("self", "cls")]
    return len(named) + (args.vararg is not None) + (args.kwarg is not None)


def test_no_function_is_over_60_lines_or_8_parameters():
    too_big = [
        f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines, "
        f"{parameters(node)} parameters)"
        for path in sources() for node in functions(path)
        if node.end_lineno - node.lineno + 1 > MAX_LINES or parameters(node) > MAX_PARAMETERS
    ]
    assert too_big == []


def test_no_private_sqlalchemy_api():
    private = re.compile(r"from sqlalchemy[\w.]* import .*\b_\w|sqlalchemy(\.\w+)*\._\w|\._handle_dbapi_exception")
    found = [f"{path.name}:{i}" for path in sources() for i, line in enumerate(path.read_text().splitlines(), 1)
             if private.search(line)]
    assert found == []


def comment_and_docstring_lines(path: Path):
    text = path.read_text()
    for i, line in enumerate(text.splitlines(), 1):
        if "#" in line:
            yield i, line[line.index("#"):]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield getattr(node, "lineno", 1), doc


def test_no_measured_figures_in_code_comments_or_docstrings():
    found = [f"{path.relative_to(REPO)}:{i}: {FIGURE.search(text).group(0)}"
             for path in sources() if "bench" not in path.parts
             for i, text in comment_and_docstring_lines(path) if FIGURE.search(text)]
    assert found == []
