"""Caption cleaning of LlamaGen's text-to-image pipeline, before FLAN-T5 sees the prompt.

LlamaGen's T5 embedder (``language/t5.py``, adapted from PixArt and DeepFloyd IF) runs the same
cleaning twice on every caption, as in training: it lower-cases the caption and drops URLs,
HTML, @names, CJK ideographs, file names, long numbers, shop phrases ("free shipping") and
stray punctuation. T5 is case-sensitive, so a prompt that skips this step conditions the model on
text it never saw in training.

This module reproduces those rules with the standard library only. The official code also uses
``ftfy.fix_text`` and BeautifulSoup; here :func:`_fix_text` and :class:`_TextOfHtml` do what those
do to prompts: Unicode NFC, ligatures and full-width letters to plain ones, curly quotes to
straight ones, line breaks and control characters; tag removal with entity decoding. What is not
reproduced: ftfy's repair of mojibake (text decoded with the wrong encoding, such as "cafÃ©"),
which a typed prompt does not contain.
"""

from __future__ import annotations

import html
import html.entities
import re
import unicodedata
from html.parser import HTMLParser
from urllib.parse import unquote_plus

__all__ = ["clean_caption"]

_TLDS = r"(?:com|co|ru|net|org|edu|gov|it)"
# A scheme ("http:", "https:", "www:") with what follows it, or a host name ending in a TLD with
# its path; the same expression is applied once per scheme kind, as the official code does.
_URLS = [re.compile(r"\b((?:" + scheme + r":(?:/{1,3}|[a-zA-Z0-9%])|[a-zA-Z0-9.\-]+[.]" + _TLDS
                    + r"[\w/-]*\b/?(?!@)))") for scheme in ("https?", "www")]
_DASHES = ("\u002d\u058a\u05be\u1400\u1806\u2010-\u2015\u2e17\u2e1a\u2e3a\u2e3b\u2e40\u301c"
           "\u3030\u30a0\ufe31\ufe32\ufe58\ufe63\uff0d")
_BAD_PUNCTUATION = re.compile("[" + re.escape("#®•©™&@·º½¾¿¡§~)(][}{|\\/*") + "]+")
_FILE_TYPES = r"(?:png|jpg|jpeg|bmp|webp|eps|pdf|apk|mp4)"

# (pattern, replacement) in the official order, before and after the HTML step and ftfy.
_BEFORE_HTML = [(re.compile("<person>"), "person")] + [(url, "") for url in _URLS]
_AFTER_HTML = [
    (re.compile(r"@[\w\d]+\b"), ""),                         # @nicknames
    (re.compile("[\u31c0-\u9fff]+"), ""),                    # CJK strokes .. unified ideographs
    (re.compile("[" + _DASHES + "]+"), "-"),                 # every kind of dash
    (re.compile("[`´«»“”¨]"), '"'),
    (re.compile("[‘’]"), "'"),
    (re.compile("&quot;?"), ""),
    (re.compile("&amp"), ""),
    (re.compile(r"\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}"), " "),  # IP addresses
    (re.compile(r"\d:\d\d\s+$"), ""),                       # article ids at the end
    (re.compile(r"\\n"), " "),                               # a written backslash-n
    (re.compile(r"#\d{1,3}\b"), ""),
    (re.compile(r"#\d{5,}\b"), ""),
    (re.compile(r"\b\d{6,}\b"), ""),
    (re.compile(r"[\S]+\." + _FILE_TYPES), ""),              # file names
    (re.compile("[\"']{2,}"), '"'),
    (re.compile(r"[.]{2,}"), " "),
    (_BAD_PUNCTUATION, " "),
    (re.compile(r"\s+\.\s+"), " "),
]
_WORD_JOINERS = re.compile(r"[-_]")  # more than three: words joined-like-this become separate
_AFTER_FTFY = [
    (re.compile(r"\b[a-zA-Z]{1,3}\d{3,15}\b"), ""),          # jc6640
    (re.compile(r"\b[a-zA-Z]+\d+[a-zA-Z]+\b"), ""),          # jc6640vc
    (re.compile(r"\b\d+[a-zA-Z]+\d+\b"), ""),                # 6640vc231
    (re.compile(r"(worldwide\s+)?(free\s+)?shipping"), ""),
    (re.compile(r"(free\s)?download(\sfree)?"), ""),
    (re.compile(r"\bclick\b\s(?:for|on)\s\w+"), ""),
    (re.compile(r"\b" + _FILE_TYPES + r"(\simage[s]?)?"), ""),
    (re.compile(r"\bpage\s+\d+\b"), ""),
    (re.compile(r"\b\d*[a-zA-Z]+\d+[a-zA-Z]+\d+[a-zA-Z\d]*\b"), " "),  # j2d1a2a...
    (re.compile(r"\b\d+\.?\d*[xх×]\d+\.?\d*\b"), ""),       # sizes such as 1920x1080
    (re.compile(r"\b\s+:\s+"), ": "),
    (re.compile(r"(\D[,./])\b"), r"\1 "),
    (re.compile(r"\s+"), " "),
    (re.compile(r"^[\"']([\w\W]+)[\"']$"), r"\1"),           # one pair of quotes around it all
    (re.compile(r"^['_,\-:;]"), ""),
    (re.compile(r"['_,\-:+]$"), ""),
    (re.compile(r"^\.\S+$"), ""),
]


class _TextOfHtml(HTMLParser):
    """The text of an HTML fragment as BeautifulSoup's ``html.parser`` builder gives it.

    Tags, comments and declarations are dropped, and so is the text of ``script``, ``style`` and
    ``template`` elements; CDATA text is kept. Character references are decoded by the parser's
    own callbacks (not ``convert_charrefs``), which is what makes an unknown ``&name;`` come out
    as ``&name`` and a bare ``&`` plus letters at the very end lose its ``&``, as there.
    """

    HIDDEN = ("script", "style", "template")

    def __init__(self) -> None:
        super().__init__(convert_charrefs=False)
        self.parts: list[str] = []
        self.hidden = 0

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.hidden += tag in self.HIDDEN

    def handle_endtag(self, tag: str) -> None:
        self.hidden -= tag in self.HIDDEN and self.hidden > 0

    def handle_data(self, data: str) -> None:
        if not self.hidden:
            self.parts.append(data)

    def handle_entityref(self, name: str) -> None:
        self.handle_data(html.entities.html5.get(name + ";", "&" + name))

    def handle_charref(self, name: str) -> None:
        code = int(name[1:], 16) if name[:1] in "xX" else int(name)
        self.handle_data(chr(code) if 0 < code < 0x110000 else "\ufffd")

    def unknown_decl(self, data: str) -> None:
        if data[:6].upper() == "CDATA[":
            self.handle_data(data[len("CDATA["):])

    @classmethod
    def text(cls, markup: str) -> str:
        parser = cls()
        parser.feed(markup)
        parser.close()
        return "".join(parser.parts)


_QUOTES = str.maketrans({"‚": "'", "‛": "'", "„": '"', "‟": '"',
                         "\u2028": "\n", "\u2029": "\n", "\u0085": "\n", "\u3000": " "})


def _fix_text(text: str) -> str:
    """What ``ftfy.fix_text`` does to a typed prompt (see the module docstring)."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").translate(_QUOTES)
    text = "".join(unicodedata.normalize("NFKC", ch) if "\ufb00" <= ch <= "\ufb06" else ch for ch in text)
    text = "".join(chr(ord(ch) - 0xFEE0) if "\uff01" <= ch <= "\uff5e" else ch for ch in text)
    text = "".join(ch for ch in text if ch in "\t\n" or unicodedata.category(ch) != "Cc")
    return unicodedata.normalize("NFC", text)


def _clean_once(caption: str) -> str:
    caption = unquote_plus(str(caption)).strip().lower()
    for pattern, replacement in _BEFORE_HTML:
        caption = pattern.sub(replacement, caption)
    caption = _TextOfHtml.text(caption)
    for pattern, replacement in _AFTER_HTML:
        caption = pattern.sub(replacement, caption)
    if len(_WORD_JOINERS.findall(caption)) > 3:
        caption = _WORD_JOINERS.sub(" ", caption)
    caption = html.unescape(html.unescape(_fix_text(caption))).strip()
    for pattern, replacement in _AFTER_FTFY:
        caption = pattern.sub(replacement, caption)
    return caption.strip()


def clean_caption(caption: str) -> str:
    """The caption as LlamaGen's text-to-image pipeline hands it to T5 (cleaned twice, as there)."""
    return _clean_once(_clean_once(caption))
