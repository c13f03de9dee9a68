"""What a node shows (why it stopped, its summary): one plain line of at most ``LINE_LIMIT``
characters.

ComfyUI shows an exception's message on the node (and the pack's script shows it in red inside
the node), and a refusal that ``VALIDATE_INPUTS`` returns likewise. :func:`shorten_messages`
wraps a node class's function so that what it raises is one line without terminal codes; the
``VALIDATE_INPUTS`` refusals pass through :func:`one_line` themselves (ComfyUI reads that
method's parameters, which a wrapper would hide). A longer message is cut at a word, says so,
and is written whole to the console log.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from ..sjd_core.messages import plain

LINE_LIMIT = 400  # the most characters of a message shown on a node
MORE = " ... (the whole message is in ComfyUI's console log)"
# The exception types a shortened message keeps (their subclasses may need other arguments).
# torch's out-of-memory error passes as it is: ComfyUI recognises its type and frees memory.
KINDS = (FileNotFoundError, ImportError, MemoryError, ValueError, TypeError, RuntimeError)
log = logging.getLogger("sjd")


def one_line(message: str) -> str:
    """``message`` as one plain line of at most ``LINE_LIMIT`` characters; a message that had to
    be cut is written whole to the console log."""
    line = " ".join(plain(message).split())
    if len(line) <= LINE_LIMIT:
        return line
    log.warning("SJD, in full: %s", plain(message))
    cut = line[: LINE_LIMIT - len(MORE)]
    return cut[: cut.rfind(" ")] + MORE if " " in cut else cut + MORE


def _shortened(function: Callable) -> Callable:
    @functools.wraps(function)
    def call(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except KINDS as error:
            line = one_line(str(error))
            if line == str(error) or isinstance(error, torch.OutOfMemoryError):
                raise
            kind = next(k for k in KINDS if isinstance(error, k))
            raise kind(line) from error
    return call


def shorten_messages(node_class: type) -> type:
    """Wrap ``node_class``'s function so that what it raises shows as :func:`one_line` words it."""
    setattr(node_class, node_class.FUNCTION, _shortened(getattr(node_class, node_class.FUNCTION)))
    return node_class
