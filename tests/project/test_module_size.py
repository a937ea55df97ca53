"""Modules of one idea: no module of ``shardio``, ``preprocess`` or ``bench`` holds more than ``MAX_CODE_LINES``
lines of code (docstrings, comments and blank lines aside). A module that grows past it has taken on a second
idea: split it by concern, as ``docs/CODE_MAP.md`` lists them."""

from __future__ import annotations

import ast
import io
import pathlib
import tokenize

import preprocess
import shardio

MAX_CODE_LINES = 400
PACKAGES = (pathlib.Path(shardio.__file__).parent, pathlib.Path(preprocess.__file__).parent)
BENCH_DIR = PACKAGES[0].parent / "bench"  # its modules only: bench/out holds what the benchmarks install
_LAYOUT = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}


def code_lines(source: str) -> int:
    """Lines holding code: a line of a docstring (module, class, function), a comment or a blank line is not."""
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and \
                    isinstance(first.value.value, str):
                docstrings.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in _LAYOUT:
            lines.update(n for n in range(token.start[0], token.end[0] + 1) if n not in docstrings)
    return len(lines)


def test_the_counter_counts_code_and_not_docstrings_comments_or_blanks():
    source = '''"""A module docstring
over two lines."""

# a comment
import os  # a trailing comment


class A:
    """A class docstring."""

    def f(self) -> str:
        """A function docstring,
        two lines."""
        text = """a string that is
        not a docstring"""
        return text + os.sep
'''
    # import, class, def, the string's two lines, return
    assert code_lines(source) == 6


def test_no_module_is_over_the_limit():
    paths = [path for package in PACKAGES for path in sorted(package.rglob("*.py"))] + sorted(BENCH_DIR.glob("*.py"))
    counts = {str(path.relative_to(BENCH_DIR.parent)): code_lines(path.read_text()) for path in paths}
    assert sum(path.startswith("bench/") for path in counts) > 20 and len(counts) > 150  # every folder walked
    over = {path: n for path, n in counts.items() if n > MAX_CODE_LINES}
    assert not over, f"modules over {MAX_CODE_LINES} lines of code (split them by concern): {over}"
