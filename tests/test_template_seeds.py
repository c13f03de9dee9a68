"""The templates' seed controls: a generation template draws a new image on every Run, as
ComfyUI's own templates do (a "fixed" seed makes a second Run return the cached image); the AR vs
AUTO comparison keeps one fixed seed for both samplers, so the pair stays comparable run after run.

A saved node's widget values hold the seed's control ("fixed", "increment", "decrement",
"randomize") right after the seed.
"""

from __future__ import annotations

import json

from tests.pack import REPO, import_pack

TEMPLATES = REPO / "workflows"
COMPARISON = "SJD AR vs AUTO (reference)"
SAMPLER = "SJDSamplerV2"


def seed_and_control(node: dict) -> tuple[int, str]:
    """The saved seed and its control, found from the node class's inputs."""
    names = []
    cls = import_pack().NODE_CLASS_MAPPINGS[node["type"]]
    for section in ("required", "optional"):
        for name, spec in cls.INPUT_TYPES().get(section, {}).items():
            if isinstance(spec[0], list) or spec[0] in ("INT", "FLOAT", "STRING", "BOOLEAN"):
                names.append(name)
                if spec[1].get("control_after_generate"):
                    names.append(f"{name} control")
    values = dict(zip(names, node["widgets_values"], strict=True))
    return values["seed"], values["seed control"]


def samplers(path) -> list[dict]:
    return [n for n in json.loads(path.read_text())["nodes"] if n["type"] == SAMPLER]


def test_generation_templates_randomise_their_seed():
    generation = [p for p in sorted(TEMPLATES.glob("*.json")) if p.stem != COMPARISON]
    assert len(generation) >= 6
    for path in generation:
        nodes = samplers(path)
        assert nodes, path.name
        for node in nodes:
            seed, control = seed_and_control(node)
            assert isinstance(seed, int) and control == "randomize", (path.name, seed, control)


def test_the_comparison_template_shares_one_fixed_seed():
    pair = [seed_and_control(n) for n in samplers(TEMPLATES / f"{COMPARISON}.json")]
    assert len(pair) == 2
    assert len({seed for seed, _ in pair}) == 1, pair
    assert {control for _, control in pair} == {"fixed"}, pair
