"""Function lengths outside the tests: the body from its first statement after the docstring to
its last line, for every function and method of ``nodes/`` and ``sjd_core/``.

    python3 tests/function_lengths.py            # the counts over 40 and over 60 lines
    python3 tests/function_lengths.py --list 40  # and every function over 40 lines, longest first
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("nodes", "sjd_core")


def body_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the first statement that is not the docstring to the function's last line."""
    body = function.body
    if (len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)):
        body = body[1:]
    return function.end_lineno - body[0].lineno + 1


def function_lengths(root: Path = ROOT) -> list[tuple[int, str]]:
    """(body lines, 'file:line name') of every function and method in the packages."""
    found = []
    for package in PACKAGES:
        for file in sorted((root / package).rglob("*.py")):
            tree = ast.parse(file.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    where = f"{file.relative_to(root)}:{node.lineno} {node.name}"
                    found.append((body_lines(node), where))
    return sorted(found, reverse=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", type=int, metavar="LINES",
                        help="also list every function whose body is longer than this")
    args = parser.parse_args()
    lengths = function_lengths()
    print(f"functions: {len(lengths)}; bodies over 40 lines: "
          f"{sum(n > 40 for n, _ in lengths)}; over 60 lines: {sum(n > 60 for n, _ in lengths)}")
    if args.list is not None:
        for lines, where in lengths:
            if lines > args.list:
                print(f"{lines:4d}  {where}")


if __name__ == "__main__":
    main()
