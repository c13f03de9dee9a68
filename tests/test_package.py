"""What the ComfyUI registry gets: the zip and the metadata ``comfy node publish`` sends.

comfy-cli (``comfy node pack`` and ``comfy node publish``, ``comfy_cli/file_utils.py``,
``zip_files``) zips the files ``git ls-files`` lists, less those matching ``.comfyignore`` (read as
.gitignore lines, comments and blank lines dropped), and adds every file on disk under the folders
named by ``[tool.comfy] includes``, which ``.comfyignore`` cannot take out. ``packed_names`` below
follows those rules with git's own .gitignore matching (comfy-cli uses the pathspec package's
implementation of the same rules, which this suite does not install). Where comfy-cli is installed,
``test_comfy_cli_packs_the_same_files`` runs its own ``zip_files`` and compares.
"""

from __future__ import annotations

import os
import re
import subprocess
import tomllib
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
META = tomllib.loads((REPO / "pyproject.toml").read_text())
INCLUDES = META["tool"]["comfy"]["includes"]
WEIGHTS = "sjd_core/models/reference/weights"
# What a user's ComfyUI loads and reads: the entry point, the nodes and the core, the web
# extension and node docs, the templates and their thumbnails, the template category's name.
RUNTIME_FILES = ("__init__.py", "requirements.txt", "README.md", "LICENSE", "pyproject.toml")
RUNTIME_FOLDERS = ("nodes", "sjd_core", "web", "workflows", "locales")
# What stays in the repository only: the suite, the CI script, the publish workflow, git's and
# comfy-cli's own lists.
LEFT_OUT_FOLDERS = ("tests/", ".ci/", ".github/")
LEFT_OUT_FILES = (".gitignore", ".comfyignore")
# comfy-cli's accepted values (comfy_cli/registry/config_parser.py,
# validate_and_extract_accelerator_classifiers / validate_and_extract_os_classifiers).
REGISTRY_ACCELERATORS = {"GPU :: NVIDIA CUDA", "GPU :: AMD ROCm", "GPU :: Intel Arc",
                         "NPU :: Huawei Ascend", "GPU :: Apple Metal"}
REGISTRY_OS_PREFIXES = ("Microsoft", "POSIX", "MacOS", "OS Independent")


def git(*args: str) -> list[str]:
    done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                          check=True)
    return [line for line in done.stdout.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def tracked() -> list[str]:
    try:
        top = git("rev-parse", "--show-toplevel")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: comfy-cli packs the git-tracked files")
    if Path(top[0]).resolve() != REPO:
        pytest.skip("the repository root is not a git work tree's top")
    return git("ls-files")


def under(path: str, folders) -> bool:
    return any(path == f.rstrip("/") or path.startswith(f.rstrip("/") + "/") for f in folders)


def packed_names(tracked: list[str]) -> set[str]:
    """The names in the zip comfy-cli would build from this checkout."""
    ignore = REPO / ".comfyignore"
    ignored = set(git("ls-files", "--cached", "--ignored", f"--exclude-from={ignore}")
                  ) if ignore.is_file() else set()
    names = {path for path in tracked
             if (under(path, INCLUDES) or path not in ignored) and (REPO / path).is_file()}
    for folder in INCLUDES:
        for root, _, files in os.walk(REPO / folder):
            names.update((Path(root) / f).relative_to(REPO).as_posix() for f in files)
    return names


def test_the_published_zip_leaves_out_the_tests_and_the_ci_script(tracked):
    names = packed_names(tracked)
    assert any(under(path, LEFT_OUT_FOLDERS) for path in tracked)  # there is something to leave
    assert sorted(p for p in names if under(p, LEFT_OUT_FOLDERS) or p in LEFT_OUT_FILES) == []
    # Nothing else is left out: every other tracked file ships (comfy-cli skips a tracked file
    # deleted from the work tree).
    present = [p for p in tracked if (REPO / p).is_file()]
    assert sorted(p for p in present if p not in names) == sorted(
        p for p in present if under(p, LEFT_OUT_FOLDERS) or p in LEFT_OUT_FILES)


def test_the_published_zip_has_everything_the_pack_runs_on(tracked):
    names = packed_names(tracked)
    for path in RUNTIME_FILES:
        assert path in names, path
    for folder in RUNTIME_FOLDERS:
        shipped = [p for p in tracked if under(p, [folder])]
        assert shipped and all(p in names for p in shipped), folder
    weights = {f"{WEIGHTS}/{f}" for f in ("model.safetensors", "codebook.safetensors",
                                          "classifier.safetensors", "config.json",
                                          "reference.json", "LICENSE")}
    assert weights <= names
    assert WEIGHTS in INCLUDES  # comfy-cli adds the embedded model even if git or .comfyignore
    assert "nodes/__init__.py" in names and "web/js/sjd_progress.js" in names
    assert any(p.startswith("workflows/") and p.endswith(".json") for p in names)


def test_comfy_cli_packs_the_same_files(tracked, tmp_path, monkeypatch):
    file_utils = pytest.importorskip("comfy_cli.file_utils",
                                     reason="comfy-cli is not installed (pip install comfy-cli)")
    monkeypatch.chdir(REPO)  # zip_files packs the current directory, as `comfy node pack` does
    target = tmp_path / "node.zip"
    file_utils.zip_files(str(target), includes=INCLUDES)
    with zipfile.ZipFile(target) as archive:
        names = set(archive.namelist())
    assert names == packed_names(tracked)
    assert not any(under(p, LEFT_OUT_FOLDERS) for p in names)


def test_registry_metadata_licence_urls_and_devices():
    project = META["project"]
    licence = (REPO / "LICENSE").read_text()
    assert licence.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "END OF TERMS AND CONDITIONS" in licence
    # PEP 639: an SPDX expression (what `comfy node init` writes) and the files it covers; a
    # "License ::" classifier beside it is an error in setuptools 77 and later.
    assert project["license"] == "Apache-2.0"
    assert all((REPO / f).is_file() for f in project["license-files"])
    assert "LICENSE" in project["license-files"]
    assert not any(c.startswith("License ::") for c in project["classifiers"])
    # comfy-cli reads Homepage, Documentation, Repository and Issues.
    urls = project["urls"]
    assert "Bug Tracker" not in urls and urls["Issues"].endswith("/issues")
    assert urls["Issues"].startswith(urls["Repository"])
    # README, Install: CUDA, Apple MPS and --cpu. The CPU has no classifier; an "Environment ::"
    # value comfy-cli does not know would drop the accelerators from what it publishes.
    environment = {c.removeprefix("Environment :: ") for c in project["classifiers"]
                   if c.startswith("Environment ::")}
    assert environment == {"GPU :: NVIDIA CUDA", "GPU :: Apple Metal"}
    assert environment <= REGISTRY_ACCELERATORS
    systems = [c.removeprefix("Operating System :: ") for c in project["classifiers"]
               if c.startswith("Operating System ::")]
    assert systems and all(s.startswith(REGISTRY_OS_PREFIXES) for s in systems)
    assert re.search(r"on CUDA, Apple MPS\s+and `--cpu`", (REPO / "README.md").read_text())


def test_comfy_cli_reads_the_metadata_as_meant():
    config_parser = pytest.importorskip("comfy_cli.registry.config_parser",
                                        reason="comfy-cli is not installed (pip install comfy-cli)")
    config = config_parser.extract_node_configuration(str(REPO / "pyproject.toml"))
    assert config.project.license.text == "Apache-2.0"
    assert config.project.urls.issues == META["project"]["urls"]["Issues"]
    assert sorted(config.project.supported_accelerators) == ["GPU :: Apple Metal",
                                                             "GPU :: NVIDIA CUDA"]
    assert config.project.supported_os == ["OS Independent"]
    assert config.tool_comfy.includes == [WEIGHTS]


RAW = "https://raw.githubusercontent.com/sjd-pack/sjd-autoregressive/main/"


@pytest.mark.parametrize("field, wide", [("Icon", False), ("Banner", True)])
def test_the_listings_icon_and_banner_are_images_of_this_repository(field, wide):
    from PIL import Image

    url = META["tool"]["comfy"][field]
    assert url.startswith(RAW), url
    with Image.open(REPO / url.removeprefix(RAW)) as image:
        width, height = image.size
    assert image.format == "PNG" and (width >= 3 * height if wide else width == height), url


def test_requires_comfyui_is_the_oldest_comfyui_the_ci_runs():
    """The oldest ComfyUI of the CI (tests/comfyui_harness.py) is older than ComfyUI's numbered
    releases (it has no comfyui_version.py), so the floor is the first numbered release; the
    newest ComfyUI of the CI lies above it."""
    sys.path.insert(0, str(REPO / "tests"))
    import comfyui_current
    import comfyui_harness

    try:
        oldest = comfyui_harness.comfyui_source()
    except RuntimeError:
        pytest.skip("the 2024 ComfyUI is not installed (python3 tests/comfyui_harness.py install)")
    version_file = oldest / "comfyui_version.py"
    floor = (re.search(r'"(\d+\.\d+\.\d+)"', version_file.read_text())[1]
             if version_file.is_file() else "0.0.1")
    assert META["tool"]["comfy"]["requires-comfyui"] == f">={floor}"
    newest = tuple(int(part) for part in comfyui_current.COMFYUI_VERSION.split("."))
    assert newest >= tuple(int(part) for part in floor.split("."))
    readme = (REPO / "README.md").read_text()
    assert f"to {comfyui_current.COMFYUI_VERSION}" in readme and "March 2024" in readme


def test_the_publish_workflow_publishes_on_a_change_of_pyproject_in_this_repository_only():
    workflow = (REPO / ".github" / "workflows" / "publish.yml").read_text()
    assert "uses: Comfy-Org/publish-node-action@v1" in workflow
    assert re.search(r"push:\s+branches: \[main\]\s+paths: \[pyproject\.toml\]", workflow)
    assert "if: ${{ github.repository_owner == 'sjd-pack' }}" in workflow
    assert "personal_access_token: ${{ secrets.REGISTRY_ACCESS_TOKEN }}" in workflow
