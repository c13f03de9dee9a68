"""The documentation names only what exists: every file, function, class, constant and trace key
that docs/algorithms.md writes as code is found in the project's sources."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALGORITHMS = ROOT / "docs" / "algorithms.md"
SOURCES = [p for p in (*ROOT.glob("sjd_core/**/*.py"), *ROOT.glob("nodes/*.py"),
                        *ROOT.glob("tests/*.py")) if p.name != "test_docs.py"]  # not itself
CODE_NAME = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*(?:\(\))?")
FILE_NAME = re.compile(r"[\w./-]+\.(?:py|md|json)")
OUTSIDE = ("torch.", "np.", "numpy.")  # names of the libraries the core uses


def defined_names(source: str) -> set[str]:
    """Every name a module defines or spells: functions, classes, methods, assigned names and
    attributes, arguments, keywords, and string constants (trace keys, setting values)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.keyword) and node.arg:
            names.add(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)
    return names


def is_code_name(span: str) -> bool:
    """A span that reads as a name in code rather than as mathematics or a word: dotted, called,
    or with an underscore between words of two letters or more (``x_k``, ``left_k`` are maths)."""
    if span.startswith(OUTSIDE):
        return False
    if "." in span or span.endswith("()"):
        return True
    words = [w for w in span.split("_") if w]
    return "_" in span and len(words) > 1 and all(len(w) > 1 for w in words)


def named_in(text: str) -> tuple[set[str], set[str]]:
    """The files and the code names written as code spans in ``text``."""
    spans = {span.strip() for span in re.findall(r"`([^`\n]+)`", text)}
    files = {span for span in spans if FILE_NAME.fullmatch(span)}
    names = {span for span in spans - files if CODE_NAME.fullmatch(span) and is_code_name(span)}
    return files, names


def missing(text: str) -> list[str]:
    """What ``text`` names that no source file defines and no project file is called."""
    project_files = {p.name for p in ROOT.rglob("*") if ".git" not in p.parts}
    defined = set().union(*(defined_names(p.read_text(encoding="utf-8")) for p in SOURCES))
    defined |= {part for p in SOURCES for part in p.relative_to(ROOT).with_suffix("").parts}
    files, names = named_in(text)
    absent = [f for f in files
              if not (ROOT / f).exists() and f.rsplit("/", 1)[-1] not in project_files]
    absent += [n for n in names if not set(n.removesuffix("()").split(".")) <= defined]
    return sorted(absent)


def test_every_name_in_the_algorithms_page_exists():
    text = ALGORITHMS.read_text(encoding="utf-8")
    files, names = named_in(text)
    assert {"engine.py", "planner.py", "verify.py"} <= files and len(names) > 40
    assert missing(text) == []


def test_the_name_check_sees_a_name_that_is_gone():
    text = ("`verify_tree`, `sjd_core.decoding.sampling.process` and `sjd_core/decoding/engine.py`,"
            " with `x_k` and `torch.lerp`")
    assert missing(text) == []
    gone = "`_copies_from_above`, `Trace.no_such_method()` and `sjd_core/decoding/gone.py`"
    assert missing(gone) == ["Trace.no_such_method()", "_copies_from_above",
                             "sjd_core/decoding/gone.py"]
