"""Reading the files and folders a user points the pack at, so that no entry can hang or flood it.

A checkpoint folder is the user's to fill, and anything can sit in it: a FIFO named
``config.json`` (reading it blocks for ever), a link to ``/dev/zero`` (reading it never ends), a
symbolic-link loop, a link to nothing, a folder that cannot be read, JSON nested 100,000 deep or
holding ``Infinity``. Every read of the pack goes through this module:

* :func:`read_bytes` / :func:`read_text` open only a regular file (links followed to one), at
  most ``limit`` bytes, checked again on the open handle;
* :func:`parse_json` refuses nesting deeper than ``MAX_JSON_DEPTH`` and the non-finite numbers
  JSON itself does not have, and :func:`read_json_object` wants an object at the top;
* :func:`json_field` reads one field of such an object with its type checked, so that an error
  names the file and the field;
* :func:`list_folder` lists a folder entry by entry: an entry that cannot be read is reported,
  never fatal to the listing;
* :func:`describe_entry` says what sits at a path, in words, for error messages.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path

from .messages import first_line, quote

MAX_TEXT_BYTES = 64 * 2**20  # the largest text or JSON file read (tokenizers are a few MB)
MAX_JSON_DEPTH = 64  # nesting of arrays and objects; checkpoint files and traces use under 10
DAMAGED = "the file is damaged or incomplete; download it again"  # what to do about a bad file

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_BRACKET_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}
_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a regular file"))


def _kind_of_mode(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "a special file")


def describe_entry(path: str | os.PathLike) -> str:
    """What is at ``path``, links followed: ``a regular file``, ``a folder``, ``a FIFO (named
    pipe)``, ``a symbolic-link loop``, ``a symbolic link to nothing``, ``missing``, ..."""
    try:
        return _kind_of_mode(os.stat(path).st_mode)
    except FileNotFoundError:
        return "a symbolic link to nothing" if os.path.islink(path) else "missing"
    except NotADirectoryError:  # a path through a file: nothing can be there
        return "missing"
    except OSError as error:
        if error.errno == getattr(os, "ELOOP", 40) or "loop" in str(error).lower():
            return "a symbolic-link loop"
        return f"unreadable ({first_line(error)})"


def is_regular_file(path: str | os.PathLike) -> bool:
    """True when ``path`` is a regular file (links followed); never raises."""
    return describe_entry(path) == "a regular file"


def require_regular_file(path: str | os.PathLike, what: str = "file") -> Path:
    """``path`` when it is a regular file; FileNotFoundError when nothing is there, ValueError
    naming what is there otherwise (a FIFO, a device, a loop...)."""
    kind = describe_entry(path)
    if kind == "missing":
        raise FileNotFoundError(f"{what} {quote(str(path))} does not exist.")
    if kind != "a regular file":
        raise ValueError(f"{what} {quote(str(path))} is {kind}, not a regular file: the pack reads "
                         "only regular files (or links to one); replace it with the real file.")
    return Path(path)


def present_regular_file(path: str | os.PathLike, what: str = "file") -> bool:
    """True when ``path`` is a regular file, False when nothing is there; ValueError (as
    :func:`require_regular_file`) when something else is (a FIFO, a device, a loop...)."""
    try:
        require_regular_file(path, what)
    except FileNotFoundError:
        return False
    return True


def read_bytes(path: str | os.PathLike, limit: int = MAX_TEXT_BYTES, what: str = "file") -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them.

    FileNotFoundError when nothing is there; ValueError when it is no regular file, is larger
    than ``limit`` or cannot be read. The file is checked before it is opened and again on the
    open handle, and opened without blocking, so a FIFO put there meanwhile cannot hang the read.
    """
    require_regular_file(path, what)
    try:
        handle = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {quote(str(path))} does not exist.") from None
    except OSError as error:
        raise ValueError(f"{what} {quote(str(path))} cannot be opened ({first_line(error)}); "
                         "check that it is readable.") from None
    with os.fdopen(handle, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{what} {quote(str(path))} is {_kind_of_mode(info.st_mode)}, not a "
                             "regular file: the pack reads only regular files.")
        if info.st_size > limit:
            raise ValueError(_too_large(path, what, info.st_size, limit))
        try:
            data = file.read(limit + 1)
        except OSError as error:
            raise ValueError(f"{what} {quote(str(path))} cannot be read ({first_line(error)}); "
                             "check that it is readable.") from None
    if len(data) > limit:
        raise ValueError(_too_large(path, what, len(data), limit))
    return data


def _too_large(path: str | os.PathLike, what: str, size: int, limit: int) -> str:
    return (f"{what} {quote(str(path))} holds {size:,} bytes or more, above the {limit:,} this "
            "pack reads from such a file: it is not the file the checkpoint ships.")


def _decode(data: bytes, source: str, remedy: str) -> str:
    """``data`` as UTF-8; ValueError ``{source} it is not UTF-8 text (...)`` when it is not."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{source} it is not UTF-8 text ({first_line(error)}): {remedy}.") from None


def read_text(path: str | os.PathLike, limit: int = MAX_TEXT_BYTES, what: str = "file") -> str:
    """The UTF-8 text of the regular file ``path`` (see :func:`read_bytes`)."""
    return _decode(read_bytes(path, limit, what), f"{what} {quote(str(path))}:", DAMAGED)


def json_depth(text: str, cap: int = MAX_JSON_DEPTH) -> int:
    """How deep the arrays and objects of the JSON ``text`` nest (brackets inside strings do
    not count); counting stops once it passes ``cap``."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    deepest = 0
    for depth in accumulate(_BRACKET_STEP[b] for b in brackets):
        if depth > deepest:
            deepest = depth
            if deepest > cap:
                break
    return deepest


def _finite_number(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is too large for a 64-bit float")
    return value


def _refuse_constant(name: str) -> float:
    raise ValueError(f"it holds {name}, which is not a JSON number")


def parse_json(text: str | bytes, source: str, remedy: str = DAMAGED) -> object:
    """The JSON value of ``text`` (bytes are read as UTF-8); ``source`` names it in errors (``file '/x/config.json'``,
    ``trace: the text``), ``remedy`` says what to do. ValueError when it does not parse, nests
    deeper than ``MAX_JSON_DEPTH``, or holds NaN, Infinity or a number too large for a float."""
    if isinstance(text, bytes):
        text = _decode(text, f"{source} is not valid JSON:", remedy)
    if not isinstance(text, str):
        raise ValueError(f"{source} is not valid JSON: it must be text, got "
                         f"{type(text).__name__}; {remedy}.")
    if json_depth(text) > MAX_JSON_DEPTH:
        raise ValueError(f"{source} is not valid JSON for this pack (its arrays and objects nest "
                         f"more than {MAX_JSON_DEPTH} deep): {remedy}.")
    try:
        return json.loads(text, parse_float=_finite_number, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as error:
        raise ValueError(f"{source} is not valid JSON ({first_line(error)}): {remedy}.") from None


def read_json_object(path: str | os.PathLike, what: str = "file") -> dict:
    """The JSON object in the regular file ``path``; FileNotFoundError when nothing is there,
    ValueError naming the file when it is not a readable, well-formed object."""
    source = f"{what} {quote(str(path))}"
    data = parse_json(read_bytes(path, what=what), source)
    if not isinstance(data, dict):
        raise ValueError(f"{source} must hold a JSON object ({{...}}), got "
                         f"{_json_type(data)}: {DAMAGED}.")
    return data


_NO_DEFAULT = object()
_KIND_WORDS = {"int": "an integer", "number": "a finite number", "str": "a string",
               "object": "an object", "int list": "a list of integers",
               "number list": "a list of finite numbers", "str list": "a list of strings"}


def _json_type(value: object) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "true/false",
             int: "an integer", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def json_field(data: dict, name: str, source: str, kind: str, default: object = _NO_DEFAULT,
               minimum: int | None = None, length: int | None = None) -> object:
    """``data[name]`` checked to be of ``kind``, one of ``_KIND_WORDS`` (integers: not a bool,
    at least ``minimum``; lists: of ``length`` items when given); ``default`` when the field is
    absent, if given. ValueError naming ``source``, the field, its value and what is allowed."""
    if name not in data:
        if default is _NO_DEFAULT:
            raise ValueError(f"{source} lacks the field {quote(name)} ({_KIND_WORDS[kind]}); the "
                             "file is damaged or not the checkpoint's.")
        return default
    value = data[name]
    is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    is_number = lambda v: is_int(v) or (isinstance(v, float) and math.isfinite(v))  # noqa: E731
    at_least = lambda v: minimum is None or v >= minimum  # noqa: E731
    checks = {
        "int": lambda v: is_int(v) and at_least(v),
        "number": is_number,
        "str": lambda v: isinstance(v, str),
        "object": lambda v: isinstance(v, dict),
        "number list": lambda v: isinstance(v, list) and all(map(is_number, v)),
        "int list": lambda v: isinstance(v, list) and all(is_int(x) and at_least(x) for x in v),
        "str list": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    }
    fits = checks[kind](value) and (length is None or len(value) == length)
    if not fits:
        wanted = _KIND_WORDS[kind]
        if length is not None:
            wanted = wanted.replace("a list of", f"a list of {length}")
        if minimum is not None:
            wanted += f" >= {minimum}"
        raise ValueError(f"{source}: field {quote(name)}={quote(value)} is not allowed: it must be "
                         f"{wanted}, got {_json_type(value)}; fix the field or download the file "
                         "again.")
    return value


@dataclass(frozen=True)
class FolderEntry:
    """One entry of a listed folder: a folder or a regular file (links followed)."""

    name: str
    path: Path
    is_folder: bool


def list_folder(folder: str | os.PathLike) -> tuple[list[FolderEntry], list[str]]:
    """(entries, problems): the folders and regular files in ``folder``, sorted by name without
    case, and one sentence for each entry left out (a loop, a link to nothing, a FIFO, an entry
    that cannot be read) or for the folder itself when it cannot be listed. Never raises for
    what is on disk."""
    entries: list[FolderEntry] = []
    problems: list[str] = []
    try:
        with os.scandir(folder) as scan:
            names = [(item.name, item.path) for item in scan]
    except OSError as error:
        return [], [f"{quote(str(folder))} cannot be listed ({describe_entry(folder)}: "
                    f"{first_line(error)})"]
    for name, path in sorted(names, key=lambda item: item[0].lower()):
        kind = describe_entry(path)
        if kind in ("a folder", "a regular file"):
            entries.append(FolderEntry(name, Path(path), kind == "a folder"))
        else:
            problems.append(f"{quote(name)} is {kind}")
    return entries, problems
