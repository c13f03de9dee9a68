"""What every command-line entry point of the pack shares: one-line errors with exit code 2.

The tools (``sjd_core.tools``) and the checkpoint converters beside the families
(``python -m sjd_core.models.movqgan``, ``python -m sjd_core.models.llamagen_checkpoint``) use
it, so a mistake a user can make (a bad argument, a missing, damaged or refused file, a device
this machine lacks, an output path that is taken) prints one line instead of a traceback.
Importing it is cheap (no torch).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NoReturn, TypeVar

from .messages import quote

Result = TypeVar("Result")
USAGE_ERROR = 2  # the exit code of argparse's own errors, used for every mistake a user can make
HINT = "run with --help for the options"


def one_line(text: object) -> str:
    """``text`` with its line breaks and runs of spaces folded into single spaces."""
    return " ".join(str(text).split())


def fail(prog: str, message: object, hint: str = HINT) -> NoReturn:
    """Print ``prog: error: message (hint)`` as one line on stderr and exit with code 2."""
    print(f"{prog}: error: {one_line(message)} ({hint})", file=sys.stderr, flush=True)
    raise SystemExit(USAGE_ERROR)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with its errors in the tools' one-line form (no usage block)."""

    def error(self, message: str) -> NoReturn:
        fail(self.prog, message)


def run_command(prog: str, command: Callable[[], Result]) -> Result:
    """Run ``command``; a ValueError or an OSError about a path (a bad prompt, setting or file,
    a folder that cannot be written) becomes one line on stderr and exit code 2 instead of a
    traceback."""
    try:
        return command()
    except (ValueError, OSError) as error:
        fail(prog, error if isinstance(error, ValueError) or not error.filename
             else f"{quote(str(error.filename))}: {error.strerror or error}")


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{quote(text)} is not allowed: it must be an integer >= 0")
    return value


def device_name(text: str) -> str:
    """argparse type: a torch device this machine has (``cpu``, ``cuda``, ``cuda:1``...)."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{quote(text)} is not a torch device; use cpu, cuda or "
                                         "cuda:N") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not count:
            raise argparse.ArgumentTypeError(f"{quote(text)} is not available: this machine has no "
                                             "CUDA device torch can use; use cpu")
        if device.index is not None and device.index >= count:
            raise argparse.ArgumentTypeError(f"{quote(text)} is not available: this machine has "
                                             f"{count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    elif device.type not in ("cpu", "mps"):
        raise argparse.ArgumentTypeError(f"{quote(text)} is not allowed: use cpu or cuda")
    return text


def output_folder(text: str) -> str:
    """argparse type: a folder to write into (it may not exist yet; an existing file is refused)."""
    import os

    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{quote(text)} is a file, not a folder; name a folder "
                                         "(it is made when missing)")
    return text


def new_file(text: str) -> str:
    """argparse type: a file to write (refused when it is a folder or its folder is missing)."""
    import os

    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{quote(text)} is a folder; name a file to write")
    parent = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"{quote(text)} cannot be written: the folder "
                                         f"{quote(parent)} does not exist")
    return text
