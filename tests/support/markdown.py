"""Reading the project's Markdown pages: fenced blocks, headings (as anchors) and links."""

from __future__ import annotations

import pathlib
import re
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parents[2]

_FENCE = re.compile(r"^(```+)\s*([\w+-]*)")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_CODE_SPAN = re.compile(r"`+[^`]*`+")
_ANCHOR_TAG = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


@dataclass(frozen=True)
class Fenced:
    """One fenced code block: its info string's language and its text (without the fences)."""

    lang: str
    text: str
    line: int  #: 1-based line of the opening fence


def split(text: str) -> tuple[list[Fenced], list[str]]:
    """The fenced blocks of a page, and its other lines (blank where a block was)."""
    blocks: list[Fenced] = []
    prose: list[str] = []
    body: list[str] = []
    fence, lang, start = "", "", 0
    for number, line in enumerate(text.splitlines(), 1):
        opening = _FENCE.match(line)
        if not fence and opening:
            fence, lang, start, body = opening.group(1), opening.group(2), number, []
            prose.append("")
        elif fence and line.strip() == fence:
            blocks.append(Fenced(lang, "".join(f"{b}\n" for b in body), start))
            fence = ""
            prose.append("")
        elif fence:
            body.append(line)
            prose.append("")
        else:
            prose.append(line)
    assert not fence, f"a fence opened on line {start} is never closed"
    return blocks, prose


def fenced_blocks(page: pathlib.Path, lang: str) -> list[str]:
    """The texts of the page's blocks fenced as ``lang`` (```sh, ```python), in order."""
    return [b.text for b in split(page.read_text())[0] if b.lang == lang]


def anchors(page: pathlib.Path) -> set[str]:
    """The fragments a link to the page may name: GitHub's heading slugs, and ``<a id>``s."""
    _, prose = split(page.read_text())
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in prose:
        found.update(_ANCHOR_TAG.findall(line))
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def links(page: pathlib.Path) -> list[str]:
    """Every link and image target in the page's prose (not in code)."""
    _, prose = split(page.read_text())
    text = _CODE_SPAN.sub("", "\n".join(prose))
    return _LINK.findall(text)


@dataclass(frozen=True)
class Block:
    """A fenced block of one page, found by a string that only it contains there."""

    page: str  #: path from the repository root, e.g. ``docs/admission.md``
    lang: str
    marker: str

    def matches(self, page: str, lang: str, text: str) -> bool:
        """Whether this names the given block."""
        return (page, lang) == (self.page, self.lang) and self.marker in text

    def text(self) -> str:
        """The block's text, as a user would paste it."""
        found = [b for b in fenced_blocks(ROOT / self.page, self.lang) if self.marker in b]
        where = f"```{self.lang} blocks of {self.page}"
        assert len(found) == 1, f"{len(found)} {where} hold {self.marker!r}"
        return found[0]
