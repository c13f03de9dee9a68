"""How error messages show what a user gave: quoted, and never more than a few lines long.

A value is quoted with :func:`quote` (its ``repr``, cut to ``QUOTE_LIMIT`` characters), so that a
100,000-character prompt gives a message that still fits on a screen. :func:`first_line` reads
the first line of another library's error message (as plain text), or says there was none;
:func:`unpickling_problem` says in the pack's own words why torch's weights-only loader refused a
file, :func:`missing_library` names the package to install for a failed import, and
:func:`plural` counts things in words.
"""

from __future__ import annotations

import re

QUOTE_LIMIT = 200  # the most characters of a value an error message shows
# A terminal's colour and style codes (ESC [ ... m and the other CSI sequences), which some
# libraries put in their messages.
_TERMINAL_CODES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# Packages the pack imports (its requirements and extras), by module name -> pip name.
PACKAGES = {"accelerate": "accelerate", "transformers": "transformers", "torchao": "torchao",
            "safetensors": "safetensors", "numpy": "numpy", "PIL": "pillow",
            "tokenizers": "tokenizers", "yaml": "pyyaml", "sentencepiece": "sentencepiece"}


def quote(value: object, limit: int = QUOTE_LIMIT) -> str:
    """``repr(value)``, cut to ``limit`` characters (with the full length) when longer; a long
    string or bytes value is cut before it is written out, so quoting it costs ``limit``."""
    text = repr(value[: limit + 1] if isinstance(value, (str, bytes)) else value)
    if len(text) <= limit and not (isinstance(value, (str, bytes)) and len(value) > limit):
        return text
    size = f"{len(value):,} characters" if isinstance(value, str) else f"{len(text):,} characters written out"
    return f"{text[:limit]}... ({size})"


def plain(text: str) -> str:
    """``text`` without terminal colour and style codes."""
    return _TERMINAL_CODES.sub("", text)


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """``1 node``, ``2 nodes``, ``1,024 codes``: a count with its noun (``nouns``: an irregular
    plural)."""
    return f"{count:,} {noun if count == 1 else nouns or noun + 's'}"


def first_line(error: BaseException) -> str:
    """The first non-empty line of ``error``'s message as plain text, quoted to ``QUOTE_LIMIT``;
    else its type."""
    for line in plain(str(error)).splitlines():
        if line.strip():
            text = line.strip()
            return text if len(text) <= QUOTE_LIMIT else text[:QUOTE_LIMIT] + "..."
    return f"{type(error).__name__} without a message"


def unpickling_problem(error: BaseException) -> tuple[bool, str]:
    """Why ``torch.load(weights_only=True)`` refused a file, in the pack's words: (True, the
    Python object it names) when the file holds code or a custom class, else (False, the
    unpickler's own short reason, or the first line of another error). torch's own advice about
    loading the file anyway is left out."""
    text = plain(str(error))
    named = re.search(r"GLOBAL ([\w.]+)", text)
    if named:
        return True, f"it names the Python object {named[1]}"
    marker = "WeightsUnpickler error:"
    if marker in text:
        rest = [line.strip() for line in text.split(marker, 1)[1].splitlines() if line.strip()]
        return False, rest[0][:QUOTE_LIMIT] if rest else "the unpickler gave no reason"
    if text.startswith("Weights only load failed"):
        return False, "it is not a weights-only pickle"
    return False, first_line(error)


def missing_library(error: ImportError) -> str | None:
    """The pip name of the package whose absence raised ``error`` (a module that is not
    installed, or a library's own message naming one of :data:`PACKAGES`), else None."""
    module = (getattr(error, "name", None) or "").split(".")[0]
    if module in PACKAGES:
        return PACKAGES[module]
    text = str(error)
    return next((name for module, name in PACKAGES.items()
                 if re.search(rf"`{module}`|'{module}'|\b{module} is not installed", text)), None)
