"""How error messages show what a user gave: quoted, and never more than a few lines long.

A value is quoted with :func:`quote` (its ``repr``, cut to ``QUOTE_LIMIT`` characters), so that a
100,000-character prompt gives a message that still fits on a screen. :func:`first_line` reads
the first line of another library's error message, or says there was none.
"""

from __future__ import annotations

QUOTE_LIMIT = 200  # the most characters of a value an error message shows


def quote(value: object, limit: int = QUOTE_LIMIT) -> str:
    """``repr(value)``, cut to ``limit`` characters (with the full length) when longer; a long
    string or bytes value is cut before it is written out, so quoting it costs ``limit``."""
    text = repr(value[: limit + 1] if isinstance(value, (str, bytes)) else value)
    if len(text) <= limit and not (isinstance(value, (str, bytes)) and len(value) > limit):
        return text
    size = f"{len(value):,} characters" if isinstance(value, str) else f"{len(text):,} characters written out"
    return f"{text[:limit]}... ({size})"


def first_line(error: BaseException) -> str:
    """The first non-empty line of ``error``'s message, quoted to ``QUOTE_LIMIT``; else its type."""
    for line in str(error).splitlines():
        if line.strip():
            text = line.strip()
            return text if len(text) <= QUOTE_LIMIT else text[:QUOTE_LIMIT] + "..."
    return f"{type(error).__name__} without a message"
