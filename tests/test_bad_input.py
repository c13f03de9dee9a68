"""Bad inputs and damaged files: every case ends in a clear error, and the next valid call works.

Each row of ``CASES`` is one thing a user can get wrong (a setting, a prompt, a damaged or
hostile checkpoint file, an edited trace, a mismatched image), the exception type and a pattern
its message must contain (the input, the value, the file where there is one, what to do), and a
valid call that must still succeed afterwards, so that no error leaves a half-loaded model or a
broken session behind. Every message must also stay short: values are quoted to 200 characters,
so a 100,000-character prompt cannot fill a screen.

Cases that would otherwise allocate without end (huge windows, batches, prompts) must fail
before any network runs; the prompt cases check that the network was never called.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from unittest import mock

import pytest
import torch

from sjd_core.decoding.engine import generate
from sjd_core.decoding.settings import AccelerationSettings, SamplingSettings
from sjd_core.decoding.trace import Trace
from sjd_core.models.protocol import GenerationRequest
from sjd_core.models.reference import WEIGHTS_DIR
from sjd_core.models.registry import load_model
from sjd_core.models.synthetic import SyntheticModel
from tests.pack import import_pack
from tests.tiny_checkpoints import cached_copy, write_janus, write_llamagen, write_lumina

torch.set_num_threads(1)
pack = import_pack()
from sjd_pack.nodes.handles import LoadedModel  # noqa: E402
from sjd_pack.nodes.loader import MANAGED  # noqa: E402
from sjd_pack.nodes.node_messages import LINE_LIMIT, shorten_messages  # noqa: E402

Sampler = pack.NODE_CLASS_MAPPINGS["SJDSampler"]
Loader = pack.NODE_CLASS_MAPPINGS["SJDModelLoader"]
Diagnostics = pack.NODE_CLASS_MAPPINGS["SJDDiagnostics"]
Decode = pack.NODE_CLASS_MAPPINGS["SJDDecode"]

LONG = "a red fox in the snow " * 4546  # 100,012 characters
MAX_MESSAGE = 1500  # characters: values are quoted to 200, so no message comes near this
WRITERS = {"lumina": (write_lumina, "Lumina-mGPT-7B-512"), "janus": (write_janus, "Janus-Pro-1B"),
           "llamagen": (write_llamagen, "LlamaGen-c2i")}
GPT, VQ = "c2i_tiny_8.pt", "vq_ds16_c2i.pt"


class Bench:
    """What the cases act on, each made once: models, intact checkpoints, a node run."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.synthetic = SyntheticModel(codebook_size=16, grid=(4, 4), seed=0)
        self.five_codes = SyntheticModel(codebook_size=5, grid=(2, 3), seed=3)
        self._folders: dict[str, Path] = {}
        self._models: dict[str, object] = {}
        self._run = None
        self._copies = 0

    def folder(self, family: str) -> Path:
        """The intact tiny checkpoint of ``family`` (never damaged: cases change copies)."""
        if family not in self._folders:
            writer, name = WRITERS[family]
            self._folders[family] = cached_copy(writer, self.tmp / "intact" / name)
        return self._folders[family]

    def model(self, family: str):
        if family not in self._models:
            self._models[family] = (load_model(WEIGHTS_DIR) if family == "reference"
                                    else load_model(self.folder(family)))
        return self._models[family]

    def damaged(self, family: str, change: Callable[[Path], None]) -> Path:
        """A fresh copy of ``family``'s checkpoint with ``change`` applied to it."""
        self._copies += 1
        source = WEIGHTS_DIR if family == "reference" else self.folder(family)
        copy = self.tmp / f"damaged-{self._copies}" / source.name
        shutil.copytree(source, copy)
        change(copy)
        return copy

    def node_run(self):
        """(codes, trace, decoded images) of one SJD Sampler run on the synthetic model."""
        if self._run is None:
            codes, trace, _ = node_sample(self)
            (images,) = Decode().decode(codes)
            self._run = (codes, trace, images)
        return self._run


def node_sample(bench: Bench, **changes):
    """The SJD Sampler node at its widget defaults (custom mode), with ``changes``."""
    values = {name: spec[1].get("default", spec[0][0] if isinstance(spec[0], list) else None)
              for name, spec in Sampler.INPUT_TYPES()["required"].items() if name != "model"}
    values.update(mode="custom", window=4, prompt="a red fox")
    values.update(changes)
    model = LoadedModel(bench.synthetic, None, "synthetic", torch.float32)
    return Sampler().sample(model, **values, unique_id="1")["result"]


# ------------------------------------------------------------------ what the cases do
def accelerate(**settings) -> Callable[[Bench], object]:
    return lambda bench: AccelerationSettings(**settings)


def sample_with(**settings) -> Callable[[Bench], object]:
    return lambda bench: SamplingSettings(**settings)


def generate_with(batch: int = 1, seed: object = 0, prompt: object = "a red fox",
                  model: str = "synthetic", **settings) -> Callable[[Bench], object]:
    def call(bench: Bench):
        request = GenerationRequest(prompt=prompt, batch_size=batch)
        return generate(getattr(bench, model), request, SamplingSettings(),
                        AccelerationSettings(**settings), seed)
    return call


def node_with(**changes) -> Callable[[Bench], object]:
    return lambda bench: node_sample(bench, **changes)


def start(family: str, **request) -> Callable[[Bench], object]:
    """``model.start`` with ``request``; the network must not have run when it is refused."""
    def call(bench: Bench):
        model = bench.model(family)
        network = getattr(model, "model", None) or model.network
        calls = []
        handle = network.register_forward_pre_hook(lambda *args: calls.append(1))
        try:
            return model.start(GenerationRequest(**request))
        finally:
            handle.remove()
            assert not calls, "the network ran before the request was refused"
    return call


def load_damaged(family: str, change: Callable[[Path], None], part: str = "") -> Callable[[Bench], object]:
    """``load_model`` on a damaged copy (``part``: a file of it to load instead of the folder)."""
    return lambda bench: load_model(bench.damaged(family, change) / part)


def write(name: str, data: bytes | str) -> Callable[[Path], None]:
    def change(folder: Path) -> None:
        (folder / name).write_bytes(data.encode() if isinstance(data, str) else data)
    return change


def truncate(name: str) -> Callable[[Path], None]:
    def change(folder: Path) -> None:
        data = (folder / name).read_bytes()
        (folder / name).write_bytes(data[: len(data) // 2])
    return change


def edit_json(name: str, edit: Callable[[dict], object]) -> Callable[[Path], None]:
    def change(folder: Path) -> None:
        data = json.loads((folder / name).read_text())
        replaced = edit(data)
        (folder / name).write_text(json.dumps(data if replaced is None else replaced))
    return change


def first_shard_named(name: str) -> Callable[[Path], None]:
    def edit(index: dict) -> None:
        first = next(iter(index["weight_map"]))
        index["weight_map"][first] = name
    return edit_json("model.safetensors.index.json", edit)


def without_letters(tokenizer: dict) -> None:
    """A vocabulary that lost its letters and names an unknown token it does not have."""
    vocab = tokenizer["model"]["vocab"]
    for token in [t for t in vocab if len(t) == 1 and t.isascii() and t.isalpha()]:
        del vocab[token]
    tokenizer["model"]["unk_token"] = "<unk>"


def save_object(name: str) -> Callable[[Path], None]:
    """A checkpoint file that pickles a Python object besides its tensors (code to run)."""
    def change(folder: Path) -> None:
        torch.save({"state_dict": {"w": torch.zeros(1)}, "path": PurePosixPath("x")}, folder / name)
    return change


def without_accelerate(bench: Bench):
    """A split (device_map) load of the reference model where accelerate is not installed."""
    with mock.patch.dict(sys.modules, {"accelerate": None, "accelerate.utils": None}):
        return load_model(WEIGHTS_DIR, device_map="auto")


def remove(name: str) -> Callable[[Path], None]:
    return lambda folder: (folder / name).unlink()


def load_path(path: str) -> Callable[[Bench], object]:
    return lambda bench: load_model(bench.tmp / path if path else bench.tmp / "nothing-here")


def empty_folder(bench: Bench):
    folder = bench.tmp / "empty-model-folder"
    folder.mkdir(exist_ok=True)
    return load_model(folder)


def loader_node_on_empty_gpt(bench: Bench):
    folder = bench.damaged("llamagen", write(GPT, b""))
    with mock.patch.dict(os.environ, {"SJD_MODELS_DIR": str(folder)}):
        return Loader().load(model=GPT, dtype="auto", placement=MANAGED)


def edited_trace(edit: Callable[[dict], None]) -> Callable[[Bench], object]:
    def call(bench: Bench):
        body = json.loads(bench.node_run()[1].trace.to_json())
        edit(body)
        return Trace.from_json(json.dumps(body))
    return call


def set_meta(**values) -> Callable[[dict], None]:
    return lambda body: body["meta"].update(values)


def set_first_value(name: str, value: object) -> Callable[[dict], None]:
    def edit(body: dict) -> None:
        values = body[name]["values"]
        while isinstance(values[0], list):
            values = values[0]
        values[0] = value
    return edit


def fifo(name: str) -> Callable[[Path], None]:
    """``name`` replaced by a FIFO: opening it for reading would block for ever."""
    def change(folder: Path) -> None:
        (folder / name).unlink(missing_ok=True)
        os.mkfifo(folder / name)
    return change


def link(name: str, target: str) -> Callable[[Path], None]:
    """``name`` replaced by a symbolic link to ``target`` ('LOOP': a link to itself)."""
    def change(folder: Path) -> None:
        (folder / name).unlink(missing_ok=True)
        (folder / name).symlink_to(folder / name if target == "LOOP" else target)
    return change


def sparse(name: str, size: int) -> Callable[[Path], None]:
    """``name`` grown to ``size`` bytes of zeros without writing them (a sparse file)."""
    def change(folder: Path) -> None:
        with open(folder / name, "r+b") as handle:
            handle.truncate(size)
    return change


def load_link(target: str) -> Callable[[Bench], object]:
    """``load_model`` on a path that is a symbolic link to ``target`` ('LOOP': to itself)."""
    def call(bench: Bench):
        path = bench.tmp / f"link-{target.strip('/').replace('/', '-')}"
        path.unlink(missing_ok=True)
        path.symlink_to(path if target == "LOOP" else target)
        return load_model(path)
    return call


def trace_text(text: str) -> Callable[[Bench], object]:
    return lambda bench: Trace.from_json(text)


def reference_batch(batch: int) -> Callable[[Bench], object]:
    """``generate`` on the embedded model; the network must not run before the refusal."""
    def call(bench: Bench):
        model = bench.model("reference")
        calls = []
        handle = model.network.register_forward_pre_hook(lambda *args: calls.append(1))
        try:
            return generate(model, GenerationRequest(prompt="a bag", batch_size=batch),
                            SamplingSettings(guidance=2.0), AccelerationSettings.preset("auto"), 0)
        finally:
            handle.remove()
            assert not calls, "the network ran before the batch was refused"
    return call


def loader_node_with_name(name: str) -> Callable[[Bench], object]:
    def call(bench: Bench):
        with mock.patch.dict(os.environ, {"SJD_MODELS_DIR": str(bench.folder("llamagen").parent)}):
            return Loader().load(model=name, dtype="auto", placement=MANAGED)
    return call


def diagnose_over(shape: tuple[int, ...], blend: float = 0.5) -> Callable[[Bench], object]:
    def call(bench: Bench):
        _, trace, _ = bench.node_run()
        return Diagnostics().diagnose(trace, blend, image=torch.zeros(shape))
    return call


# ------------------------------------------------------------------ the valid calls after
def generates(bench: Bench) -> None:
    result = generate(bench.synthetic, GenerationRequest(prompt="a red fox", batch_size=2),
                      SamplingSettings(), AccelerationSettings.preset("pac+vp", window=8), seed=1)
    assert result.codes.shape == (2, 4, 4)


def generates_on_five_codes(bench: Bench) -> None:
    settings = AccelerationSettings(window=4, proactive_drafting=True, pd_candidates=5)
    result = generate(bench.five_codes, GenerationRequest(prompt="x"), SamplingSettings(),
                      settings, seed=0)
    assert result.codes.shape == (1, 2, 3)


def node_samples(bench: Bench) -> None:
    codes, trace, line = node_sample(bench, seed=5)
    assert codes.codes.shape == (1, 4, 4) and "forward passes" in line


def reference_draws(bench: Bench) -> None:
    result = generate(bench.model("reference"), GenerationRequest(prompt="a bag"),
                      SamplingSettings(guidance=2.0), AccelerationSettings.preset("pac+vp"), seed=0)
    assert result.codes.shape == (1, 16, 16) and not result.trace.summary()["warnings"]


def starts(family: str, **request) -> Callable[[Bench], None]:
    def then(bench: Bench) -> None:
        session = bench.model(family).start(GenerationRequest(**request))
        assert session.batch_size == request.get("batch_size", 1)
    return then


def loads(family: str) -> Callable[[Bench], None]:
    def then(bench: Bench) -> None:
        folder = WEIGHTS_DIR if family == "reference" else bench.folder(family)
        assert load_model(folder).codebook_size > 0
    return then


def loader_node_loads(bench: Bench) -> None:
    with mock.patch.dict(os.environ, {"SJD_MODELS_DIR": str(bench.folder("llamagen").parent)}):
        loaded, info = Loader().load(model=bench.folder("llamagen").name, dtype="auto",
                                     placement=MANAGED)
    assert loaded.family == "llamagen" and "family llamagen" in info


def trace_reads(bench: Bench) -> None:
    trace = bench.node_run()[1].trace
    assert Trace.from_json(trace.to_json()).summary()["slots_per_image"] == 16


def diagnoses(bench: Bench) -> None:
    _, trace, images = bench.node_run()
    enlarged = images.repeat_interleave(2, 1).repeat_interleave(2, 2)  # 2 px per code: fits
    for image in (images, enlarged):
        text = Diagnostics().diagnose(trace, 0.5, image=image)["result"][4]
        assert "step compression" in text


@dataclass(frozen=True)
class Case:
    name: str
    call: Callable[[Bench], object]
    error: type[BaseException]
    message: str  # a regular expression the message must contain
    then: Callable[[Bench], None]  # a valid call that must work afterwards


CASES = [
    # --------------------------------------------------------- settings: limits in the core
    Case("window 10**6", accelerate(window=10**6), ValueError,
         r"window=1000000 is not allowed: window must be an integer in \[1, 256\]", generates),
    Case("pd_candidates 10**6", accelerate(pd_candidates=10**6), ValueError,
         r"pd_candidates=1000000 is not allowed: .* in \[1, 16\]", generates),
    Case("pd_depth 10**6", accelerate(pd_depth=10**6), ValueError,
         r"pd_depth=1000000 is not allowed: .* in \[1, 16\]", generates),
    Case("tree of 16 x 16", accelerate(window=16, proactive_drafting=True, pd_candidates=16,
                                       pd_depth=16), ValueError,
         r"pd_depth=16 .* at most 1024 nodes: .* would feed 1,229,782,938,247,303,441; lower",
         generates),
    Case("window as text", accelerate(window="16"), ValueError,
         r"window='16' is not allowed: window must be an integer", generates),
    Case("window as a bool", accelerate(window=True), ValueError,
         r"window=True is not allowed: window must be an integer", generates),
    Case("AC switch as text", accelerate(adaptive_continuation="false"), ValueError,
         r"adaptive_continuation='false' is not allowed: .* must be True or False", generates),
    Case("compile as text", accelerate(compile="on"), ValueError,
         r"compile='on' is not allowed: compile must be True, False or None \(on for CUDA "
         r"only\)", generates),
    Case("compile_stages as text", accelerate(compile_stages="yes"), ValueError,
         r"compile_stages='yes' is not allowed: compile_stages must be True or False", generates),
    Case("init of 100,000 characters", accelerate(init="x" * 100_000), ValueError,
         r"init='x{20,200}\.\.\. \(100,000 characters\) is not allowed: init must be one of",
         generates),
    Case("vp_decay 1", accelerate(vp_decay=1.0), ValueError, r"vp_decay=1.0 .* in \[0, 1\)",
         generates),
    Case("relaxed without a window", accelerate(window=1, relaxed="lantern"), ValueError,
         r"relaxed='lantern' .* 'none' when window=1 .* raise window", generates),
    Case("temperature 0", sample_with(temperature=0.0), ValueError,
         r"temperature=0.0 .* > 0 \(for greedy decoding set top_k=1\)", generates),
    Case("top_p 0", sample_with(top_p=0.0), ValueError, r"top_p=0.0 .* in \(0, 1\]", generates),
    Case("top_k 2.5", sample_with(top_k=2.5), ValueError, r"top_k=2.5 .* an integer >= 0",
         generates),
    Case("guidance NaN", sample_with(guidance=float("nan")), ValueError,
         r"guidance=nan .* a finite number", generates),
    # --------------------------------------------------------- generate()
    Case("batch_size 10**9 in AR", generate_with(batch=10**9, window=1), ValueError,
         r"batch_size=1000000000 is not allowed: .* \(1 node and a window of 1 over 16 codes",
         generates),
    Case("batch_size 10**9", generate_with(batch=10**9), ValueError,
         r"batch_size=1000000000 is not allowed: .* it would take about [\d,.]+ GiB \(16 nodes "
         r"and a window of 16 over 16 codes per image, 4x4 codes\), and [\d,.]+ GiB are free; "
         r"draw fewer",
         generates),
    Case("batch_size 0", generate_with(batch=0), ValueError,
         r"batch_size=0 is not allowed: batch_size must be an integer >= 1", generates),
    Case("pd_candidates above the codebook",
         generate_with(model="five_codes", window=4, proactive_drafting=True, pd_candidates=8),
         ValueError, r"pd_candidates=8 .* at most the model's codebook size \(5\)",
         generates_on_five_codes),
    Case("seed -1", generate_with(seed=-1), ValueError, r"seed=-1 .* \[0, 2\*\*63 - 65536\)",
         generates),
    Case("seed 2**64", generate_with(seed=2**64), ValueError,
         r"seed=18446744073709551616 is not allowed", generates),
    Case("seed 1.5", generate_with(seed=1.5), ValueError, r"seed=1.5 is not allowed", generates),
    Case("prompt None", generate_with(prompt=None), ValueError,
         r"prompt=None is not allowed: prompt must be a string", generates),
    # --------------------------------------------------------- the sampler node
    Case("node: window 10**6", node_with(window=10**6), ValueError,
         r"SJD Sampler[^:]*: mode=custom: window=1000000 is not allowed", node_samples),
    Case("node: batch_size 10**9", node_with(batch_size=10**9), ValueError,
         r"SJD Sampler[^:]*: batch_size=1000000000 is not allowed: .* GiB are free", node_samples),
    Case("node: pd_candidates 10**6", node_with(pd_candidates=10**6), ValueError,
         r"SJD Sampler[^:]*: mode=custom: pd_candidates=1000000 is not allowed", node_samples),
    # --------------------------------------------------------- prompts
    Case("reference: 100,000 characters, no class", start("reference", prompt="x" * 100_000),
         ValueError, r"prompt='x{100,200}\.\.\. \(100,000 characters\) names no known class",
         reference_draws),
    Case("reference: two classes", start("reference", prompt="a bag and a coat"), ValueError,
         r"prompt='a bag and a coat' names several classes \(coat, bag\)", reference_draws),
    Case("reference: resolution", start("reference", prompt="bag", resolution=(64, 64)),
         ValueError, r"resolution=\(64, 64\) is not allowed: .* only 32x32", reference_draws),
    Case("lumina: 100,000-character prompt", start("lumina", prompt=LONG), ValueError,
         r"prompt is [\d,]+ tokens long with lumina-mgpt's prompt template; at most [\d,]+ fit .* "
         r"shorten the prompt", starts("lumina", prompt="a red fox")),
    Case("lumina: 100,000-character negative prompt",
         start("lumina", prompt="a red fox", negative_prompt=LONG, guidance=3.0), ValueError,
         r"negative_prompt is [\d,]+ tokens long .* shorten the negative_prompt",
         starts("lumina", prompt="a red fox", guidance=3.0)),
    Case("lumina: prompts that are not text",
         start("lumina", prompt="", batch_size=2, extra={"prompts": [1, 2]}), ValueError,
         r"extra\['prompts'\]=\[1, 2\] is not allowed: it must be a list of 2 strings",
         starts("lumina", prompt="", batch_size=2, extra={"prompts": ["a", "b"]})),
    Case("janus: 100,000-character prompt", start("janus", prompt=LONG), ValueError,
         r"prompt is [\d,]+ tokens long with Janus-Pro's prompt template; at most 1,024 fit "
         r"\(Janus-Pro's context is 256 positions and the image takes 16 at this resolution; a "
         r"prompt may always have 1,024\): shorten the prompt",
         starts("janus", prompt="a red fox")),
    Case("llamagen: class index of 5,000 digits", start("llamagen", prompt="9" * 5000), ValueError,
         r"class index '9{100,200}\.\.\. \(5,000 characters\) is out of range: .* classes 0\.\.9",
         starts("llamagen", prompt="3")),
    Case("llamagen: 100,000-character class name", start("llamagen", prompt=LONG), ValueError,
         r"prompt='a red fox .*\.\.\. \(100,012 characters\) is not a class index 0\.\.9 nor a "
         r"class name listed in .*imagenet_classes.txt", starts("llamagen", prompt="goldfish")),
    # --------------------------------------------------------- damaged or hostile checkpoints
    Case("missing path", load_path("no/such/model"), FileNotFoundError,
         r"Model path '.*no/such/model' does not exist", loads("janus")),
    Case("empty folder", empty_folder, ValueError,
         r"empty-model-folder' is not a checkpoint of a known model family \(lumina-mgpt-2, "
         r".*\)\. Known families",
         loads("janus")),
    Case("llamagen: 0-byte GPT .pt", load_damaged("llamagen", write(GPT, b""), GPT), ValueError,
         r"LlamaGen weights file '.*c2i_tiny_8.pt' is empty \(0 bytes\): .* download it again",
         loads("llamagen")),
    Case("llamagen: 0-byte VQ .pt", load_damaged("llamagen", write(VQ, b"")), ValueError,
         r"weights file '.*vq_ds16_c2i.pt' is empty \(0 bytes\)", loads("llamagen")),
    Case("llamagen: truncated GPT .pt", load_damaged("llamagen", truncate(GPT)), ValueError,
         r"'.*c2i_tiny_8.pt' cannot be read as a PyTorch checkpoint \(.*\): it is truncated or "
         r"damaged; download it again", loads("llamagen")),
    Case("llamagen: GPT .pt of random bytes", load_damaged("llamagen", write(GPT, os.urandom(4096))),
         ValueError, r"'.*c2i_tiny_8.pt' cannot be read as a PyTorch checkpoint", loads("llamagen")),
    Case("llamagen: llamagen.json not JSON", load_damaged("llamagen", write("llamagen.json", "{n_head")),
         ValueError, r"'.*llamagen.json' is not valid JSON \(.*\): .* download it again",
         loads("llamagen")),
    Case("loader node: 0-byte GPT .pt", loader_node_on_empty_gpt, ValueError,
         r"SJD Model Loader: model='c2i_tiny_8.pt' \(.*\): LlamaGen weights file .* is empty",
         loader_node_loads),
    Case("janus: config.json not JSON", load_damaged("janus", write("config.json", "{\"model_type")),
         ValueError, r"'.*Janus-Pro-1B/config.json' is not valid JSON \(.*\): the file is damaged",
         loads("janus")),
    Case("lumina: config.json of binary bytes",
         load_damaged("lumina", write("config.json", bytes(range(256)))), ValueError,
         r"'.*Lumina-mGPT-7B-512/config.json' is not valid JSON", loads("lumina")),
    Case("janus: config field of the wrong type",
         load_damaged("janus", edit_json("config.json",
                                         lambda c: c["text_config"].update(hidden_size="big"))),
         ValueError, r"Janus-Pro checkpoint: '.*config.json' is not a valid JanusConfig \(.*"
         r"hidden_size.*'big'.*\); fix the field", loads("janus")),
    Case("lumina: config field of the wrong type",
         load_damaged("lumina", edit_json("config.json", lambda c: c.update(num_hidden_layers=2.5))),
         ValueError, r"lumina-mgpt checkpoint: '.*config.json' is not a valid ChameleonConfig "
         r"\(.*num_hidden_layers", loads("lumina")),
    Case("janus: truncated tokenizer.json", load_damaged("janus", truncate("tokenizer.json")),
         ValueError, r"Janus-Pro tokenizer: file '.*tokenizer.json' is not valid JSON", loads("janus")),
    Case("janus: tokenizer without its letters",
         load_damaged("janus", edit_json("tokenizer.json", without_letters)), ValueError,
         r"Janus-Pro tokenizer in '.*' \(tokenizer.json, tokenizer_config.json\) loads but cannot "
         r"encode text \(Unk token `<unk>` not found.*\): its vocabulary is damaged",
         loads("janus")),
    Case("lumina: shard name outside the folder",
         load_damaged("lumina", first_shard_named("../outside.safetensors")), ValueError,
         r"model.safetensors.index.json' names the shard '../outside.safetensors', which is not a "
         r"file inside", loads("lumina")),
    Case("lumina: absolute shard name", load_damaged("lumina", first_shard_named("/etc/passwd")),
         ValueError, r"names the shard '/etc/passwd', which is not a file inside", loads("lumina")),
    Case("lumina: weight_map is a list",
         load_damaged("lumina", edit_json("model.safetensors.index.json",
                                          lambda index: index.update(weight_map=["a"]))),
         ValueError, r"'weight_map' must map tensor names to shard file names, got \['a'\]",
         loads("lumina")),
    Case("lumina: missing shard", load_damaged("lumina", remove("model-00002-of-00003.safetensors")),
         FileNotFoundError, r"Weight shard 'model-00002-of-00003.safetensors' listed in "
         r"model.safetensors.index.json is missing .* download it again", loads("lumina")),
    Case("lumina: truncated shard", load_damaged("lumina", truncate("model-00001-of-00003.safetensors")),
         ValueError, r"Weight file '.*model-00001-of-00003.safetensors' is damaged or truncated",
         loads("lumina")),
    Case("lumina: vqgan.ckpt that pickles an object", load_damaged("lumina", save_object("vqgan.ckpt")),
         ValueError, r"Could not read '.*vqgan.ckpt' as a weights-only checkpoint \(it names the "
         r"Python object pathlib.PurePosixPath\)", loads("lumina")),
    Case("llamagen: GPT .pt that pickles an object", load_damaged("llamagen", save_object(GPT), GPT),
         ValueError, r"'.*c2i_tiny_8.pt' holds Python objects other than tensors .* \(it names the "
         r"Python object pathlib.PurePosixPath\)", loads("llamagen")),
    Case("accelerate not installed", without_accelerate, ImportError,
         r"needs the accelerate package, which is not installed: install it with `python -m pip "
         r"install accelerate`", loads("reference")),
    Case("reference: reference.json not JSON",
         load_damaged("reference", write("reference.json", "{\"family\": \"refer")), ValueError,
         r"'.*weights/reference.json' is not valid JSON", loads("reference")),
    # --------------------------------------------------------- traces
    Case("trace: 2x8 meta over 4x4 arrays", edited_trace(set_meta(grid=[2, 8])), ValueError,
         r"array 'commit_iteration' has shape \(1, 4, 4\), but the meta \(grid 2x8, batch 1\)",
         trace_reads),
    Case("trace: batch 2 in the meta", edited_trace(set_meta(batch=2)), ValueError,
         r"array 'committed_per_iteration' has shape \(\d+, 1\), but the meta", trace_reads),
    Case("trace: version 1", edited_trace(set_meta(trace_version=1)), ValueError,
         r"trace_version=1 is not supported: this pack reads trace version 2; run the sampler",
         trace_reads),
    Case("trace: unknown commit kind", edited_trace(set_first_value("commit_kind", 9)), ValueError,
         r"commit_kind holds values in \[\d, 9\], outside \[0, 5\]: the trace was edited or is "
         r"damaged; run the sampler again", trace_reads),
    Case("trace: slots committed twice",
         edited_trace(set_first_value("committed_per_iteration", 99)), ValueError,
         r"committed_per_iteration sums to \[\d+\] slots per image, not 16", trace_reads),
    Case("trace: not JSON", lambda bench: Trace.from_json("{\"meta\": "), ValueError,
         r"trace: the text is not valid JSON \(.*\): pass what Trace.to_json wrote", trace_reads),
    # --------------------------------------------------------- hostile file-system entries
    Case("lumina: config.json is a FIFO", load_damaged("lumina", fifo("config.json")), ValueError,
         r"file '.*Lumina-mGPT-7B-512/config.json' is a FIFO \(named pipe\), not a regular file",
         loads("lumina")),
    Case("janus: config.json links to /dev/zero",
         load_damaged("janus", link("config.json", "/dev/zero")), ValueError,
         r"file '.*Janus-Pro-1B/config.json' is a character device, not a regular file",
         loads("janus")),
    Case("janus: config.json is a symlink loop", load_damaged("janus", link("config.json", "LOOP")),
         ValueError, r"file '.*config.json' is a symbolic-link loop, not a regular file",
         loads("janus")),
    Case("janus: config.json of 65 MiB", load_damaged("janus", sparse("config.json", 65 * 2**20)),
         ValueError, r"file '.*config.json' holds 68,157,440 bytes or more, above the 67,108,864 "
         r"this pack reads", loads("janus")),
    Case("janus: tokenizer.json is a FIFO", load_damaged("janus", fifo("tokenizer.json")),
         ValueError, r"Janus-Pro tokenizer file '.*tokenizer.json' is a FIFO", loads("janus")),
    Case("janus: merges.txt links to /dev/zero",
         load_damaged("janus", link("merges.txt", "/dev/zero")), ValueError,
         r"Janus-Pro tokenizer file '.*merges.txt' is a character device", loads("janus")),
    Case("reference: reference.json is a FIFO", load_damaged("reference", fifo("reference.json")),
         ValueError, r"file '.*weights/reference.json' is a FIFO", loads("reference")),
    Case("lumina: index is a FIFO", load_damaged("lumina", fifo("model.safetensors.index.json")),
         ValueError, r"safetensors index '.*model.safetensors.index.json' is a FIFO",
         loads("lumina")),
    Case("lumina: a shard is a symlink loop",
         load_damaged("lumina", link("model-00002-of-00003.safetensors", "LOOP")), ValueError,
         r"weight shard '.*model-00002-of-00003.safetensors' is a symbolic-link loop",
         loads("lumina")),
    Case("llamagen: llamagen.json is a FIFO", load_damaged("llamagen", fifo("llamagen.json")),
         ValueError, r"file '.*llamagen.json' is a FIFO", loads("llamagen")),
    Case("model path is a symlink loop", load_link("LOOP"), ValueError,
         r"Model path '.*link-LOOP' is a symbolic-link loop: a checkpoint is a folder or a "
         r"weights file", loads("janus")),
    Case("model path links to /dev/zero", load_link("/dev/zero"), ValueError,
         r"Model path '.*link-dev-zero' is a character device", loads("janus")),
    # --------------------------------------------------------- valid JSON of the wrong shape
    Case("janus: config.json is a list", load_damaged("janus", write("config.json", "[1, 2]")),
         ValueError, r"file '.*config.json' must hold a JSON object \(\{...\}\), got an array",
         loads("janus")),
    Case("reference: reference.json is a string",
         load_damaged("reference", write("reference.json", '"reference"')), ValueError,
         r"file '.*reference.json' must hold a JSON object .*, got a string", loads("reference")),
    Case("reference: codebook_size as text",
         load_damaged("reference", edit_json("reference.json",
                                             lambda m: m.update(codebook_size="512"))),
         ValueError, r"reference.json': field 'codebook_size'='512' is not allowed: it must be an "
         r"integer >= 1, got a string", loads("reference")),
    Case("reference: grid of one number",
         load_damaged("reference", edit_json("reference.json", lambda m: m.update(grid=[16]))),
         ValueError, r"field 'grid'=\[16\] is not allowed: it must be a list of 2 integers >= 1",
         loads("reference")),
    Case("reference: Infinity in the grid",
         load_damaged("reference", edit_json("reference.json",
                                             lambda m: m.update(grid=[16, float("inf")]))),
         ValueError, r"reference.json' is not valid JSON \(it holds Infinity, which is not a JSON "
         r"number\)", loads("reference")),
    Case("reference: synonyms as a list",
         load_damaged("reference", edit_json("reference.json", lambda m: m.update(synonyms=[]))),
         ValueError, r"field 'synonyms'=\[\] is not allowed: it must be an object, got an array",
         loads("reference")),
    Case("reference: unknown recipe field",
         load_damaged("reference", edit_json("reference.json",
                                             lambda m: m["defaults"].update(cfg=2))),
         ValueError, r"field 'defaults' has the unknown fields \['cfg'\]", loads("reference")),
    Case("llamagen: image_size as text",
         load_damaged("llamagen", edit_json("llamagen.json", lambda m: m.update(image_size="big"))),
         ValueError, r"llamagen.json': field 'image_size'='big' is not allowed: it must be an "
         r"integer >= 1", loads("llamagen")),
    Case("llamagen: llamagen.json is a list", load_damaged("llamagen", write("llamagen.json", "[]")),
         ValueError, r"llamagen.json' must hold a JSON object", loads("llamagen")),
    Case("lumina: index nested 100,000 deep",
         load_damaged("lumina", write("model.safetensors.index.json", "[" * 100_000 + "]" * 100_000)),
         ValueError, r"model.safetensors.index.json' is not valid JSON for this pack \(its arrays "
         r"and objects nest more than 64 deep\)", loads("lumina")),
    Case("lumina: a number too large for a float",
         load_damaged("lumina", write("model.safetensors.index.json", '{"weight_map": 1e999}')),
         ValueError, r"is not valid JSON \(the number 1e999 is too large for a 64-bit float\)",
         loads("lumina")),
    Case("janus: image_mean as text",
         load_damaged("janus", edit_json("preprocessor_config.json",
                                         lambda c: c.update(image_mean="grey"))),
         ValueError, r"preprocessor_config.json': field 'image_mean'='grey' is not allowed: it "
         r"must be a list of 3 finite numbers", loads("janus")),
    Case("janus: boi_token_id as text",
         load_damaged("janus", write("generation_config.json", '{"boi_token_id": "5"}')),
         ValueError, r"generation_config.json': field 'boi_token_id'='5' is not allowed: it must be "
         r"an integer >= 0", loads("janus")),
    Case("trace: nested 100,000 deep", trace_text("[" * 100_000 + "]" * 100_000), ValueError,
         r"trace: the text is not valid JSON for this pack \(.* nest more than 64 deep\): pass "
         r"what Trace.to_json wrote", trace_reads),
    Case("trace: Infinity in an integer array",
         edited_trace(set_first_value("commit_kind", float("inf"))), ValueError,
         r"trace: the text is not valid JSON \(it holds Infinity", trace_reads),
    Case("trace: 2**70 in an integer array",
         edited_trace(set_first_value("commit_kind", 2**70)), ValueError,
         r"trace: array 'commit_kind' is missing or unreadable \(.*int.*\)", trace_reads),
    Case("trace: a list", trace_text("[]"), ValueError, r"it has no 'meta' object", trace_reads),
    Case("trace: warnings as text", edited_trace(set_meta(warnings="late")), ValueError,
         r"trace: meta warnings='late' is not allowed: it must be a list of strings", trace_reads),
    Case("trace: no run_id", edited_trace(lambda body: body["meta"].pop("run_id")), ValueError,
         r"trace: meta run_id=None is not allowed", trace_reads),
    # --------------------------------------------------------- memory and echoes
    Case("reference: batch 100,000 with auto", reference_batch(100_000), ValueError,
         r"batch_size=100000 is not allowed: .* about [\d,.]+ GiB \(\d+ nodes and a window of 32 "
         r"over 512 codes per image, 16x16 codes, guided\)", reference_draws),
    Case("preset of no name", lambda bench: AccelerationSettings.preset(None), ValueError,
         r"preset=None is not allowed: preset must be one of", generates),
    Case("loader node: a 10 MB model name", loader_node_with_name("m" * 10 * 2**20),
         FileNotFoundError, r"model='m{100,200}\.\.\. \(10,485,760 characters\) was not found",
         loader_node_loads),
    # --------------------------------------------------------- diagnostics
    Case("diagnostics: 6x6 px image over 4x4 codes", diagnose_over((1, 6, 6, 3)), ValueError,
         r"image \(1 image\(s\) of 6x6 px\) does not belong to this trace \(1 image\(s\) of "
         r"4x4 codes, drawn at 4x4 px", diagnoses),
    Case("diagnostics: other aspect ratio", diagnose_over((1, 4, 8, 3)), ValueError,
         r"image \(1 image\(s\) of 8x4 px\) does not belong", diagnoses),
    Case("diagnostics: two images for one", diagnose_over((2, 4, 4, 3)), ValueError,
         r"image \(2 image\(s\) of 4x4 px\) does not belong", diagnoses),
    Case("diagnostics: blend 2", diagnose_over((1, 4, 4, 3), blend=2.0), ValueError,
         r"blend=2.0 is not allowed: it must lie in \[0, 1\]", diagnoses),
]


@pytest.fixture(scope="module")
def bench(tmp_path_factory) -> Bench:
    return Bench(tmp_path_factory.mktemp("bad-input"))


def test_the_table_covers_at_least_70_cases():
    assert len(CASES) >= 70 and len({case.name for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_bad_input_gives_a_clear_error_and_the_next_call_works(bench, case):
    with pytest.raises(case.error) as raised:
        case.call(bench)
    message = str(raised.value)
    print(f"\n| {case.name} | {type(raised.value).__name__}: {' '.join(message.split())[:300]} |")
    assert type(raised.value) is case.error, f"{type(raised.value).__name__}: {message}"
    assert re.search(case.message, message, re.DOTALL), message
    assert len(message) < MAX_MESSAGE, f"{len(message)} characters"
    case.then(bench)


# Advice that libraries write into their messages (torch's on loading a refused file, transformers'
# and pip's on installing), which the pack words itself; and count words that "1" must not take.
FOREIGN_ADVICE = ("will likely succeed", "You can install it with", "Please use",
                  "weights_only` set to `False`", "add_safe_globals")
WRONG_PLURAL = re.compile(r"(?<![\d.,])1 (nodes|codes|images|steps|tokens|rows|iterations|files|"
                          r"classes|prompts|shapes|layers|forward passes|characters|bytes|seconds)\b")


def shown_on_a_node(case: Case, bench: Bench) -> str:
    """The message a node shows when ``case`` fails inside it: the case run as a node's function,
    wrapped as the pack wraps every node's."""
    node_class = type("Failing", (), {"FUNCTION": "run", "run": lambda self: case.call(bench)})
    with pytest.raises(Exception) as raised:
        shorten_messages(node_class)().run()
    return str(raised.value)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_each_bad_input_shows_on_a_node_as_one_plain_line_in_the_packs_words(bench, case):
    shown = shown_on_a_node(case, bench)
    assert "\n" not in shown and len(shown) <= LINE_LIMIT, (len(shown), shown)
    assert "\x1b[" not in shown, shown
    assert not [advice for advice in FOREIGN_ADVICE if advice in shown], shown
    assert not WRONG_PLURAL.search(shown), shown
    case.then(bench)


# ------------------------------------------------------------------ prompts read as nothing
@pytest.mark.parametrize("prompt", ["!!!", "\U0001f98a\U0001f98a", " ... ", "\u978b\u5b50", "\u00a7\u00b6"])
def test_a_prompt_that_names_nothing_is_refused_before_any_work(bench, prompt):
    with pytest.raises(ValueError, match=f"prompt={re.escape(repr(prompt))} names no known class"):
        start("reference", prompt=prompt)(bench)
    settings, sampling = AccelerationSettings.preset("sjd"), SamplingSettings(guidance=2.0)
    empty = generate(bench.model("reference"), GenerationRequest(prompt=""), sampling, settings, seed=3)
    assert empty.trace.summary()["unconditional"] and not empty.trace.summary()["warnings"]
    restored = Trace.from_json(empty.trace.to_json())
    assert restored.summary()["unconditional"]


@pytest.mark.parametrize("error", [
    lambda: __import__("safetensors").SafetensorError("Error while deserializing header"),
    lambda: __import__("huggingface_hub").errors.HFValidationError("Repo id must be in the form"),
])
def test_library_errors_while_building_name_the_family_and_the_checkpoint(bench, monkeypatch, error):
    """A library's own exception raised while a family builds becomes a ValueError with the
    family and the path; the loader works again afterwards."""
    from sjd_core.models import registry

    def failing(path, **options):
        raise error()

    families = tuple(replace(f, build=failing) if f.name == "janus" else f
                     for f in registry.FAMILIES)
    monkeypatch.setattr(registry, "FAMILIES", families)
    with pytest.raises(ValueError) as raised:
        load_model(bench.folder("janus"))
    message = str(raised.value)
    assert re.search(r"janus checkpoint '.*Janus-Pro-1B' could not be loaded: \w+ from "
                     r"(safetensors|huggingface_hub)\S* \(.+\); check that every file", message)
    assert type(raised.value.__cause__).__module__.split(".")[0] in registry.LIBRARIES
    monkeypatch.undo()
    loads("janus")(bench)


# ------------------------------------------------------------------ folders and the route
def test_a_models_folder_with_hostile_entries_still_lists_every_good_checkpoint(bench, tmp_path,
                                                                               caplog):
    """A symbolic-link loop, a link to nothing, a FIFO and a link to /dev/zero among the models
    leave the listing whole: each is left out and named where a model is not found (in the
    console log, when the node's one line has no room for them), and the loader still loads a
    good checkpoint from the same folder."""
    from sjd_pack.nodes.model_files import missing_model_message, model_listing

    models = tmp_path / "models"
    models.mkdir()
    (models / "good").symlink_to(bench.folder("llamagen"))
    (models / "loop").symlink_to(models / "loop")
    (models / "gone.safetensors").symlink_to(tmp_path / "nothing-here")
    os.mkfifo(models / "pipe.safetensors")
    (models / "zero.ckpt").symlink_to("/dev/zero")
    with mock.patch.dict(os.environ, {"SJD_MODELS_DIR": str(models)}):
        found, skipped = model_listing()
        message = missing_model_message("absent")
        loaded, _ = Loader().load(model="good", dtype="auto", placement=MANAGED)
    assert "good" in found and not {"loop", "gone.safetensors", "pipe.safetensors"} & set(found)
    assert [s.split(": ", 1)[1] for s in skipped] == [
        "'gone.safetensors' is a symbolic link to nothing", "'loop' is a symbolic-link loop",
        "'pipe.safetensors' is a FIFO (named pipe)", "'zero.ckpt' is a character device"]
    shown = message + " " + caplog.text
    assert "Left out of the listing" in shown and "'loop' is a symbolic-link loop" in shown
    assert len(message) <= LINE_LIMIT and "'good'" in message  # the choices come first
    assert loaded.family == "llamagen"


def test_the_resolutions_route_reads_off_the_event_loop_within_its_time_limit(monkeypatch):
    """A checkpoint whose files take too long to read answers 504 after the time limit while the
    event loop keeps running; a 10 MB model name is echoed quoted to a short answer."""
    import asyncio
    import time

    from sjd_pack.nodes import resolutions_route

    def stuck(model: str) -> tuple[int, dict]:
        time.sleep(1.0)
        return 200, {}

    async def ask_while_ticking() -> tuple[tuple[int, dict], int]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        answer = await resolutions_route.resolutions_answer("slow-model", time_limit=0.3)
        ticker.cancel()
        return answer, ticks

    monkeypatch.setattr(resolutions_route, "resolutions_for", stuck)
    (status, body), ticks = asyncio.run(ask_while_ticking())
    assert status == 504 and "longer than 0.3 s" in body["error"] and ticks >= 10
    monkeypatch.undo()
    status, body = asyncio.run(resolutions_route.resolutions_answer("m" * 10 * 2**20))
    assert status == 200 and body["resolutions"] is None and len(json.dumps(body)) < 4 * MAX_MESSAGE
    assert "(10,485,760 characters)" in body["error"]
    status, body = asyncio.run(resolutions_route.resolutions_answer("reference (embedded)"))
    assert status == 200 and body["resolutions"] == ["32x32"]


# ------------------------------------------------------------------ memory
PEAK_SCRIPT = """
import sys, torch
from torch.profiler import ProfilerActivity, profile
torch.set_num_threads(1)
from sjd_core.decoding import engine
from sjd_core.decoding.settings import AccelerationSettings, SamplingSettings
from sjd_core.models.protocol import GenerationRequest
from sjd_core.models.registry import load_model
batch, folder, prompt, *modes = sys.argv[1:]
model = load_model(folder, device="cpu")
request = GenerationRequest(prompt=prompt, batch_size=int(batch))
estimates = []  # what the batch check of each measured run estimated
original = engine.decoding_bytes
engine.decoding_bytes = lambda *args: estimates.append(original(*args)) or estimates[-1]
class Enough(Exception):
    pass
def stop_after_24(report):  # the cache is whole from the first forward; the shapes vary
    if report.iteration == 23:
        raise Enough
for mode in modes:
    settings, sampling = AccelerationSettings.preset(mode), SamplingSettings(guidance=2.0)
    estimates.clear()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as run:
        try:
            engine.generate(model, request, sampling, settings, seed=0, on_iteration=stop_after_24)
        except Enough:
            pass
    held = peak = 0  # the allocator's bytes in use, event by event, and their largest value
    for event in sorted(run.events(), key=lambda e: e.time_range.start):
        held += event.self_cpu_memory_usage
        peak = max(peak, held)
    print(mode, estimates[0], peak)
"""


@pytest.mark.slow
@pytest.mark.parametrize("family", ["reference", "lumina-mgpt"])
def test_the_batch_check_estimates_the_peak_within_2x(family, tmp_path):
    """The batch check's estimate (the KV cache with guidance, mask, attention, activations,
    logits and drafts at the largest shape) against the peak of the bytes torch's CPU allocator
    held (profiled) over the first 24 iterations of a batch, in AR and auto: 64 images of
    16x16 codes on the embedded model, 16 of 32x32 codes on a tiny Lumina-mGPT checkpoint. The
    cache is allocated whole before the first forward."""
    import subprocess
    import sys

    if family == "reference":
        folder, batch, prompt = WEIGHTS_DIR, "64", "a bag"
    else:
        folder, batch, prompt = cached_copy(write_lumina, tmp_path / "Lumina-mGPT-7B-512"), "16", "a red fox"
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, batch, str(folder), prompt, "ar", "auto"],
                         capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr[-2000:]
    measured = [line.split() for line in out.stdout.splitlines()[-2:]]
    assert [mode for mode, _, _ in measured] == ["ar", "auto"]
    for mode, estimate, peak in ((mode, int(e), int(p)) for mode, e, p in measured):
        print(f"\n| {family}, {mode}, batch {batch} | estimate {estimate / 2**20:.0f} MiB | peak "
              f"{peak / 2**20:.0f} MiB | ratio {estimate / peak:.2f} |")
        assert 0.5 <= estimate / peak <= 2.0, f"{mode}: {estimate} estimated, {peak} held"
