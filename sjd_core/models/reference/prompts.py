"""How a text prompt becomes one of the reference model's ten classes.

The rule, in order:

1. The prompt is lower-cased, ``-``/``_``/``/`` become spaces and other punctuation is dropped,
   and runs of spaces collapse (so ``"T-Shirt"``, ``"t shirt"`` and ``"  T_shirt! "`` are alike).
2. An empty prompt (or one of spaces only) means *no class*: the unconditional (null) context,
   the one classifier-free guidance uses; the run's summary calls the image unconditional. Any
   other prompt must name a class: one that step 1 reduces to nothing (punctuation, emoji,
   symbols, letters of another script) names no known class and is refused by step 4.
3. Otherwise every class name and synonym below is looked for as whole words in the prompt
   (``"a red sneaker on grey"`` finds ``sneaker``). Where two found phrases overlap, the longer
   wins (``"t shirt"`` beats ``"shirt"``).
4. Exactly one class must be found; none, or two different classes, is a ValueError that lists
   the accepted names.
"""

from __future__ import annotations

import re

from ...messages import quote

CLASS_NAMES: tuple[str, ...] = (
    "t-shirt", "trouser", "pullover", "dress", "coat",
    "sandal", "shirt", "sneaker", "bag", "ankle boot",
)
SYNONYMS: dict[str, tuple[str, ...]] = {
    "t-shirt": ("t-shirt", "tshirt", "tee", "top", "t-shirt/top"),
    "trouser": ("trouser", "trousers", "pants", "jeans", "slacks"),
    "pullover": ("pullover", "sweater", "jumper", "sweatshirt", "hoodie"),
    "dress": ("dress", "gown", "frock"),
    "coat": ("coat", "jacket", "parka", "overcoat"),
    "sandal": ("sandal", "sandals", "flip flop", "flip flops"),
    "shirt": ("shirt", "blouse", "button down shirt"),
    "sneaker": ("sneaker", "sneakers", "trainer", "trainers", "running shoe", "running shoes"),
    "bag": ("bag", "handbag", "purse", "tote", "backpack"),
    "ankle boot": ("ankle boot", "ankle boots", "boot", "boots", "bootie"),
}


def normalise(text: str) -> str:
    """Lower-case, separators to spaces, punctuation dropped, single spaces."""
    text = re.sub(r"[-_/]", " ", text.lower())
    text = re.sub(r"[^a-z0-9 ]", "", text)
    return " ".join(text.split())


class ClassVocabulary:
    """Maps prompts to class indices with the rule of this module."""

    def __init__(self, names: list[str] | tuple[str, ...], synonyms: dict[str, list[str]]) -> None:
        self.names = tuple(names)
        phrases: dict[str, int] = {}
        for index, name in enumerate(self.names):
            for phrase in (name, *synonyms.get(name, ())):
                phrases[normalise(phrase)] = index
        # Longest first, so that a longer phrase claims its words before a shorter one inside it.
        self._phrases = sorted(phrases.items(), key=lambda item: (-len(item[0]), item[0]))

    def accepted(self) -> str:
        """The accepted names and their synonyms, for error messages and help texts."""
        groups = {}
        for phrase, index in self._phrases:
            groups.setdefault(self.names[index], []).append(phrase)
        return "; ".join(f"{name} ({', '.join(sorted(groups[name]))})" for name in self.names)

    def resolve(self, prompt: str, input_name: str = "prompt") -> int | None:
        """Class index for ``prompt``; None for an empty prompt (unconditional)."""
        if not isinstance(prompt, str):
            raise ValueError(f"{input_name}={quote(prompt)} is not allowed: it must be a string naming "
                             f"one class: {self.accepted()}.")
        if not prompt.strip():
            return None
        text = f" {normalise(prompt)} "
        found: set[int] = set()
        for phrase, index in self._phrases:
            key = f" {phrase} "
            if key in text:
                found.add(index)
                text = text.replace(key, " | ")
        if len(found) != 1:
            problem = "names no known class" if not found else (
                "names several classes (" + ", ".join(self.names[i] for i in sorted(found)) + ")")
            raise ValueError(f"{input_name}={quote(prompt)} {problem}: the reference model draws one "
                             f"Fashion-MNIST class per image; name exactly one of "
                             f"{', '.join(self.names)} (or a synonym of one: {self.accepted()}).")
        return found.pop()
