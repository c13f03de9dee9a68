"""LlamaGen (``FoundationVision/LlamaGen``), class- and text-conditional, on a stock ``LlamaForCausalLM``.

What is on disk (see :mod:`sjd_core.models.llamagen_checkpoint`): the release ``.pt`` pair
(``c2i_L_384.pt`` + ``vq_ds16_c2i.pt``, read weights-only) or its one-time safetensors conversion
(``model.safetensors`` + ``vq.safetensors`` + ``llamagen.json``). The image size is the one the
GPT was trained at (from ``llamagen.json`` or the file name); it is the only supported resolution.

Class-conditional (c2i) recipe: the prompt is a class index (``"207"``) or a class name matched,
ignoring case, against ``imagenet_classes.txt`` next to the weights (line i names class i; any of
its comma-separated synonyms matches). Guidance uses the null class (index ``num_classes``);
cfg 4.0, top-k 2000, temperature 1.0.

Text-conditional (t2i) recipe: the conditioning is FLAN-T5-XL caption features (up to 120 tokens,
2048 wide), projected by the model, left-padded with the padding masked out; guidance uses the
model's learned null caption under the same mask; cfg 7.5, top-k 1000, temperature 1.0. The
features come from, in order:

1. ``request.extra["caption_embeddings"]``: a float tensor (tokens, 2048) or (batch, tokens, 2048)
   of the caption's valid T5 tokens, with an optional bool ``request.extra["caption_mask"]``
   (same leading shape) marking valid tokens; or the path of a ``.safetensors`` file holding
   ``caption_embeddings`` (and optionally ``caption_mask``);
2. a T5 encoder folder next to the weights (``flan-t5-xl/`` or ``t5-ckpt/flan-t5-xl/``, a
   transformers ``T5EncoderModel`` with its tokenizer), run on ``request.prompt`` after the
   official caption cleaning (:func:`~sjd_core.models.llamagen_caption.clean_caption`: lower case,
   no URLs or HTML, ...), as LlamaGen's T5 embedder does in training and sampling. An empty
   prompt draws from the empty caption, without a description (the run's summary calls it
   unconditional); a non-empty prompt that the cleaning empties (only punctuation or symbols)
   is refused before any work.

Anything else is refused with a message saying so. The prompt of a t2i model is not tokenised by
the GPT itself: there is no text vocabulary in it.

Sequence layout: the conditioning tokens take positions ``0 .. cond_tokens - 1`` (LlamaGen's 2D
rotary table zeroes their queries and keys, so their exact positions do not change any value), the
last one is the slot -1 token, and image slot k sits at position ``cond_tokens + k``. A caption
shorter than ``cond_tokens`` is fed without its masked padding: dropping a masked entry and
shifting the image positions by the padding length gives the same attention as LlamaGen's
left-padded, masked sequence.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ..files import is_regular_file, list_folder, present_regular_file, read_text, require_regular_file
from ..messages import quote
from .family_common import check_codes, pick_grid, to_images
from .hf_session import Context, DecoderParts, HFSession
from .llamagen_checkpoint import (CLASS_NAMES_FILE, GPT_SAFETENSORS, SIDECAR, VQ_SAFETENSORS, LlamaGenSpec,
                                  build_gpt, build_vq, image_size_from_name, infer_spec,
                                  read_settings, read_state_dict, safetensors_shapes, shapes_of, vq_downsample,
                                  vq_to_janus)
from .llamagen_caption import clean_caption
from .llamagen_modules import LlamaGenTransformer
from .weights import input_device, quantization_config, resolve_device_dtype, safetensors_files
from .protocol import GenerationRequest, MemoryShape, SamplingDefaults

T5_FOLDERS = ("flan-t5-xl", "t5-ckpt/flan-t5-xl")
# GETTING_STARTED.md's FID sampling commands: --cfg-scale per class-conditional GPT, by model width
# (GPT-B 768, GPT-L 1024, GPT-XL 1280, GPT-XXL 1536, GPT-3B 3200)
EVALUATION_GUIDANCE = {768: 2.0, 1024: 2.0, 1280: 1.75, 1536: 1.75, 3200: 1.65}
SAMPLE_SCRIPT = "sample script"
FID_EVALUATION = "FID evaluation"
RECIPE_NAMES = (SAMPLE_SCRIPT, FID_EVALUATION)  # every recipe name a LlamaGen GPT may have


def llamagen_recipes(spec: LlamaGenSpec) -> dict[str, SamplingDefaults]:
    """The official recipes of a LlamaGen GPT: its sample script first, then (c2i of a published
    size) the FID evaluation setting."""
    if spec.kind == "t2i":
        return {SAMPLE_SCRIPT: SamplingDefaults(
            guidance=7.5, temperature=1.0, top_k=1000,
            source="LlamaGen autoregressive/sample/sample_t2i.py defaults")}
    recipes = {SAMPLE_SCRIPT: SamplingDefaults(
        guidance=4.0, temperature=1.0, top_k=2000,
        source="LlamaGen autoregressive/sample/sample_c2i.py defaults")}
    if spec.dim in EVALUATION_GUIDANCE:
        recipes[FID_EVALUATION] = SamplingDefaults(
            guidance=EVALUATION_GUIDANCE[spec.dim], temperature=1.0, top_k=0,
            source="LlamaGen GETTING_STARTED.md sampling commands (--cfg-scale of this GPT size) "
                   "with autoregressive/sample/sample_c2i_ddp.py defaults (no top-k)")
    return recipes
_GPT_NAME = re.compile(r"^(c2i|t2i)_.*\.(pt|safetensors)$")


class LlamaGenModel:
    """LlamaGen behind the adapter protocol (see the module docstring for the recipes)."""

    family = "llamagen"

    def __init__(self, model: LlamaGenTransformer, vq, spec: LlamaGenSpec, folder: Path) -> None:
        self.model, self.vq, self.spec, self.folder = model, vq, spec, folder
        self.device = input_device(model)
        self.dtype = next(model.parameters()).dtype
        self.memory_shape = MemoryShape.of_config(model.config, self.dtype)
        self.codebook_size = int(vq.config.num_embeddings)
        side = int(vq.config.num_patches)
        self._grids = {(spec.image_size, spec.image_size): (side, side)}
        self.recipes = llamagen_recipes(spec)
        self.defaults = next(iter(self.recipes.values()))
        self._class_names = self._read_class_names() if spec.kind == "c2i" else {}
        self._t5 = None

    # ------------------------------------------------------------------ layout
    def supported_resolutions(self) -> list[tuple[int, int]]:
        return list(self._grids)

    def grid_for(self, resolution: tuple[int, int] | None) -> tuple[int, int]:
        return pick_grid(f"LlamaGen ({self.spec.kind}, trained at {self.spec.image_size} px)",
                         resolution, self._grids)

    def codebook_embeddings(self) -> torch.Tensor:
        """The VQ codebook as its decoder sees it (L2-normalised rows)."""
        return torch.nn.functional.normalize(self.vq.quantize.embedding.weight.detach().float(), dim=-1)

    # ------------------------------------------------------------------ conditioning
    def _read_class_names(self) -> dict[str, int]:
        file = self.folder / CLASS_NAMES_FILE
        if not present_regular_file(file, "class names file"):
            return {}
        names: dict[str, int] = {}
        for index, line in enumerate(read_text(file, what="class names file").splitlines()):
            for name in [line] + line.split(","):
                names.setdefault(name.strip().lower(), index)
        names.pop("", None)
        return names

    def class_index(self, prompt: str) -> int:
        """The class of a c2i prompt: an index, or a name from ``imagenet_classes.txt``."""
        text = prompt.strip()
        n = self.spec.num_classes
        if re.fullmatch(r"\d+", text):
            if len(text.lstrip("0")) > len(str(n)) or int(text) >= n:
                raise ValueError(f"class index {quote(text)} is out of range: this LlamaGen model has "
                                 f"classes 0..{n - 1}.")
            return int(text)
        if text.lower() in self._class_names:
            return self._class_names[text.lower()]
        if not self._class_names:
            raise ValueError(f"prompt={quote(prompt)} is not a class index, and there is no {CLASS_NAMES_FILE} "
                             f"in {quote(str(self.folder))} to look names up: give an index 0..{n - 1}, or "
                             f"add that file (one class name per line, line i = class i).")
        raise ValueError(f"prompt={quote(prompt)} is not a class index 0..{n - 1} nor a class name listed in "
                         f"{quote(str(self.folder / CLASS_NAMES_FILE))}.")

    def _embed(self, inputs: torch.Tensor) -> torch.Tensor:
        weight = next(self.model.cond_embedder.parameters())
        device = self.device if weight.is_meta else weight.device  # meta: offloaded, its hook loads it
        inputs = inputs.to(device, self.dtype if inputs.is_floating_point() else None)
        return self.model.cond_embedder(inputs).to(self.device, self.dtype)

    def _class_contexts(self, request: GenerationRequest) -> tuple[list[Context], list[Context] | None]:
        labels = torch.tensor([self.class_index(request.prompt), self.spec.num_classes])
        cond, null = self._embed(labels)  # (1, dim) each
        uncond = [Context(embeds=null)] * request.batch_size if request.guidance != 1.0 else None
        return [Context(embeds=cond)] * request.batch_size, uncond

    def caption_features(self, request: GenerationRequest) -> list[torch.Tensor]:
        """Per image, the (valid tokens, caption_dim) T5 features of its caption."""
        extra = request.extra or {}
        if "caption_embeddings" in extra:
            return self._given_features(extra, request.batch_size)
        encoder = self._t5_encoder()
        tokenizer, t5 = encoder
        ids = tokenizer(clean_caption(request.prompt), max_length=self.spec.cond_tokens, truncation=True,
                        return_tensors="pt")["input_ids"].to(t5.device)
        with torch.no_grad():
            features = t5(input_ids=ids).last_hidden_state[0].float()
        return [features] * request.batch_size

    def _given_features(self, extra: dict, batch_size: int) -> list[torch.Tensor]:
        features, mask = extra["caption_embeddings"], extra.get("caption_mask")
        if isinstance(features, (str, Path)):
            from safetensors.torch import load_file

            loaded = load_file(str(require_regular_file(features, "extra['caption_embeddings'] file")))
            if "caption_embeddings" not in loaded:
                raise ValueError(f"{quote(str(features))} holds no 'caption_embeddings' tensor "
                                 f"(found {sorted(loaded)}).")
            features, mask = loaded["caption_embeddings"], loaded.get("caption_mask", mask)
        if not isinstance(features, torch.Tensor) or features.dim() not in (2, 3) \
                or features.shape[-1] != self.spec.caption_dim:
            shape = tuple(features.shape) if isinstance(features, torch.Tensor) else type(features).__name__
            raise ValueError(f"caption_embeddings has shape {shape}; it must be (tokens, "
                             f"{self.spec.caption_dim}) or (batch, tokens, {self.spec.caption_dim}) "
                             f"FLAN-T5 features.")
        if features.dim() == 2:
            features = features[None]
            mask = None if mask is None else mask.reshape(1, -1)
        if features.shape[0] not in (1, batch_size):
            raise ValueError(f"caption_embeddings has {features.shape[0]} captions for batch_size={batch_size}: "
                             f"give one caption, or one per image.")
        if mask is None:
            mask = torch.ones(features.shape[:2], dtype=torch.bool)
        mask = mask.to(torch.bool).reshape(features.shape[:2])
        rows = [features[b][mask[b]] for b in range(features.shape[0])]
        for b, row in enumerate(rows):
            if not 1 <= len(row) <= self.spec.cond_tokens:
                raise ValueError(f"caption {b} has {len(row)} valid tokens; it needs 1 to "
                                 f"{self.spec.cond_tokens}.")
        return rows * (batch_size // len(rows))

    def _t5_encoder(self):
        if self._t5 is None:
            folder = next((self.folder / name for name in T5_FOLDERS
                           if (self.folder / name / "config.json").is_file()), None)
            if folder is None:
                raise ValueError(
                    "This text-conditional LlamaGen model needs FLAN-T5-XL caption features. Either pass "
                    "precomputed features as extra['caption_embeddings'] (a (tokens, "
                    f"{self.spec.caption_dim}) tensor or a .safetensors file), or put the google/flan-t5-xl "
                    f"encoder (config.json, model weights, tokenizer) in {quote(str(self.folder / T5_FOLDERS[0]))}.")
            from transformers import AutoTokenizer, T5EncoderModel

            tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
            t5 = T5EncoderModel.from_pretrained(str(folder), local_files_only=True,
                                                dtype=self.dtype).to(self.device).eval()
            self._t5 = (tokenizer, t5)
        return self._t5

    def _caption_contexts(self, request: GenerationRequest) -> tuple[list[Context], list[Context] | None]:
        """Each caption's valid tokens, with the slot -1 token where the padded sequence puts it."""
        features = self.caption_features(request)
        null = self.model.cond_embedder.uncond_embedding
        last = self.spec.cond_tokens - 1
        cond, uncond = [], []
        for row in features:
            valid = len(row)
            cond.append(Context(embeds=self._embed(row), position=last))
            # LlamaGen's null caption under the same mask: its last `valid` rows
            uncond.append(Context(embeds=self._embed(null[self.spec.cond_tokens - valid:]), position=last))
        return cond, (uncond if request.guidance != 1.0 else None)

    # ------------------------------------------------------------------ session
    def parts(self) -> DecoderParts:
        backbone = self.model.model
        return DecoderParts(backbone=backbone, embed_tokens=backbone.embed_tokens,
                            embed_codes=backbone.embed_tokens, code_logits=self.model.lm_head,
                            row_end_id=None, device=self.device, dtype=self.dtype)

    def start(self, request: GenerationRequest) -> HFSession:
        grid = self.grid_for(request.resolution)
        empty = self.spec.kind == "t2i" and self._caption_is_empty(request)
        if self.spec.kind == "c2i":
            cond, uncond = self._class_contexts(request)
        else:
            cond, uncond = self._caption_contexts(request)
        session = HFSession(self.parts(), cond, uncond, grid, request.max_nodes)
        session.unconditional = empty
        return session

    def _caption_is_empty(self, request: GenerationRequest) -> bool:
        """Whether T5 is to read an empty caption (an empty prompt: drawn without a description);
        a prompt that the caption cleaning empties (only punctuation, say) is refused before the
        T5 encoder loads."""
        prompt = request.prompt
        if "caption_embeddings" in (request.extra or {}) or not isinstance(prompt, str):
            return False
        if not prompt.strip():
            return True
        if not clean_caption(prompt):
            raise ValueError(f"prompt={quote(prompt)} is empty after LlamaGen's caption cleaning "
                             "(which drops URLs, HTML and many punctuation marks and symbols), so it "
                             "describes nothing to draw: describe the image in words, or leave the "
                             "prompt empty to draw without a description.")
        return False

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        check_codes("LlamaGen", codes, self.codebook_size)
        side = next(iter(self._grids.values()))
        if tuple(codes.shape[1:]) != side:
            raise ValueError(f"LlamaGen decodes {side[0]}x{side[1]} code grids, got {tuple(codes.shape[1:])}.")
        pixels = self.vq.decode(codes.flatten(1).to(next(self.vq.parameters()).device))
        return to_images(pixels, [0.5, 0.5, 0.5], [0.5, 0.5, 0.5])  # the VQ decodes to [-1, 1]


# ---------------------------------------------------------------------- finding and loading
def _checkpoint_files(path: Path) -> tuple[Path, Path]:
    """(GPT file, VQ file) for a LlamaGen folder, or for a GPT file with its VQ file beside it."""
    folder = path if path.is_dir() else path.parent
    files = [entry.path for entry in list_folder(folder)[0] if not entry.is_folder]
    if path.is_dir() and is_regular_file(path / GPT_SAFETENSORS):
        gpt = path / GPT_SAFETENSORS
    elif is_regular_file(path):
        gpt = path
    else:
        found = [p for p in files if _GPT_NAME.match(p.name)]
        if len(found) != 1:
            raise ValueError(f"{quote(str(folder))} must hold exactly one LlamaGen GPT checkpoint "
                             f"(c2i_*.pt or t2i_*.pt), found {quote([p.name for p in found])}.")
        gpt = found[0]
    vqs = [p for p in files if p.name == VQ_SAFETENSORS
           or (p.name.startswith("vq") and p.suffix in (".pt", ".safetensors"))]
    if not vqs:
        raise FileNotFoundError(f"No LlamaGen VQ tokenizer in {quote(str(folder))}: put "
                                f"vq_ds16_c2i.pt (or vq_ds16_t2i.pt) next to {quote(gpt.name)}.")
    if len(vqs) > 1:
        raise ValueError(f"{quote(str(folder))} holds several VQ files {quote([p.name for p in vqs])}; "
                         "keep one.")
    return gpt, vqs[0]



def detect(path: Path) -> bool:
    """A LlamaGen checkpoint: ``llamagen.json``, a ``c2i_*``/``t2i_*`` GPT file, or such a folder."""
    if is_regular_file(path):
        return bool(_GPT_NAME.match(path.name))
    return path.is_dir() and (is_regular_file(path / SIDECAR)
                              or any(_GPT_NAME.match(entry.name) for entry in list_folder(path)[0]))


def resolutions_on_disk(path: Path) -> list[tuple[int, int]]:
    """The trained size of a LlamaGen checkpoint, from ``llamagen.json`` or the file name."""
    gpt_file, _ = _checkpoint_files(path)
    size = read_settings(gpt_file.parent).get("image_size") or image_size_from_name(gpt_file.name)
    if size is None:
        raise ValueError(f"The image size LlamaGen checkpoint {quote(gpt_file.name)} was trained at is not in "
                         f"its name (such as c2i_L_384.pt): set \"image_size\" in {gpt_file.parent / SIDECAR}.")
    return [(int(size), int(size))]


def build(path: Path, device=None, dtype=None, device_map=None, weights: str | None = None) -> LlamaGenModel:
    """Load a LlamaGen GPT + VQ pair (``.pt`` read weights-only, or the safetensors conversion)."""
    device, dtype = resolve_device_dtype(device, dtype, weights)
    quantization = quantization_config(weights, device, keep=("cond_embedder",))
    gpt_file, vq_file = _checkpoint_files(path)
    folder = gpt_file.parent
    settings = read_settings(folder)
    size = settings.get("image_size") or image_size_from_name(gpt_file.name)
    if size is None:
        raise ValueError(f"The image size LlamaGen checkpoint {quote(gpt_file.name)} was trained at is not in "
                         f"its name (such as c2i_L_384.pt): set \"image_size\" in {folder / SIDECAR}.")
    vq_config, vq_state = vq_to_janus(read_state_dict(vq_file), source=str(vq_file))
    factor = vq_downsample(vq_config)
    if size % factor:
        raise ValueError(f"image_size {size} is not a multiple of the VQ's {factor} pixels per code.")
    vq_config.num_patches = size // factor
    if gpt_file.suffix == ".safetensors":
        files = safetensors_files(folder) if gpt_file.name == GPT_SAFETENSORS else [gpt_file]
        spec = infer_spec(safetensors_shapes(files[0]), size, settings.get("n_head"), str(gpt_file))
        model = build_gpt(files, spec, size // factor, device, dtype, device_map, quantization)
    else:
        state = read_state_dict(gpt_file)
        spec = infer_spec(shapes_of(state), size, settings.get("n_head"), str(gpt_file))
        model = build_gpt(list(state.items()), spec, size // factor, device, dtype, device_map, quantization)
        del state
    vq = build_vq(vq_config, vq_state, input_device(model), dtype)
    return LlamaGenModel(model, vq, spec, folder)


EXPECTS = ("LlamaGen's c2i_*.pt or t2i_*.pt GPT with its vq_ds16_*.pt beside it (a folder or the "
           ".pt file), or their conversion: model.safetensors + vq.safetensors + llamagen.json")
