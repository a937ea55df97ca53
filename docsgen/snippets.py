"""The documentation's Markdown as the docs tests read it: pages, fenced blocks with the marker before
each (``<!-- runs -->`` or ``<!-- illustrative -->``), links and anchors, inline code. Parsing only: the
tests in ``tests/project/test_docs.py`` and ``tests/project/test_docs_snippets.py`` decide what is wrong."""

from __future__ import annotations

import re
import shlex
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from docsgen.reference import ROOT

RUNS, ILLUSTRATIVE = "runs", "illustrative"
# Languages whose blocks must be marked: what a reader would paste into a shell or a Python file.
CHECKED = {"python": "python", "py": "python", "bash": "shell", "sh": "shell", "shell": "shell",
           "console": "shell"}
_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)(?P<lang>[\w+-]*)[^\n]*$")
_MARKER = re.compile(r"^\s*<!--\s*(runs|illustrative)\s*-->\s*$")
_LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int            # 1-based line of the opening fence
    lang: str            # the fence's language, as written
    kind: str            # "python", "shell", or "" for a language not checked
    marker: str | None   # RUNS, ILLUSTRATIVE or None
    code: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def pages() -> list[Path]:
    """The README and every Markdown page under docs/ but its notes (development notes, not the site's)."""
    docs = sorted(p for p in (ROOT / "docs").rglob("*.md") if "notes" not in p.relative_to(ROOT / "docs").parts)
    return [ROOT / "README.md", *docs]


def blocks(page: Path) -> list[Block]:
    lines = page.read_text(encoding="utf-8").splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = len(m["indent"]), m["fence"], m["lang"].lower()
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        code = "\n".join(line[indent:] for line in lines[i + 1:j])
        before = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        marker = _MARKER.match(before)
        out.append(Block(page, i + 1, lang, CHECKED.get(lang, ""), marker[1] if marker else None, code))
        i = j + 1
    return out


def prose(page: Path) -> str:
    """The page without its fenced blocks (links and inline code are looked for here)."""
    text = page.read_text(encoding="utf-8")
    return re.sub(r"^( *)(```+|~~~+).*?^\1\2\s*$", "", text, flags=re.S | re.M)


def links(page: Path) -> list[str]:
    return [m[1] or m[2] for m in _LINK.finditer(prose(page))]


def inline_code(page: Path) -> list[str]:
    return re.findall(r"(?<!`)`([^`\n]+)`(?!`)", prose(page))


def slug(heading: str) -> str:
    """An anchor as Python-Markdown's toc (MkDocs) makes it, which GitHub's agrees with for these pages."""
    text = re.sub(r"<[^>]+>", "", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    for line in prose(page).splitlines():
        m = _HEADING.match(line)
        if m:
            found.add(slug(m[2]))
    return found


def commands(code: str) -> list[list[str]]:
    """Each command line of a shell block as words (continuations joined, comments and env prefixes dropped)."""
    joined = re.sub(r"\\\n", " ", code)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
            words = words[1:]
        if words:
            out.append(words)
    return out


def program_call(words: list[str]) -> tuple[str, str | None, list[str]] | None:
    """``("preprocess", "run", [options...])`` for a call of either command line, else None."""
    if not words:
        return None
    head = words[0].rsplit("/", 1)[-1]
    rest = words[1:]
    if head.startswith("python") and rest[:2] in (["-m", "preprocess.cli"], ["-m", "shardio.tools.cli"]):
        head, rest = rest[1].split(".")[0], rest[2:]
    if head not in ("preprocess", "shardio"):
        return None
    sub = rest[0] if rest and not rest[0].startswith("-") else None
    options = [w.split("=", 1)[0] for w in rest if re.match(r"^--?[a-zA-Z]", w)]
    return head, sub, options
