"""Build the documentation site and read its HTML (shared by the docs and browser checks).

``build(dest)`` runs ``mkdocs build --strict`` as CI does; ``Page`` parses one built page
with the standard library's HTML parser: its ids, links, images, table of contents and
the text of its article outside code.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"

# Elements whose text is code or machinery, not prose.
CODE = frozenset({"code", "pre", "script", "style", "kbd", "samp", "svg"})
VOID = frozenset({"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta",
                  "source", "track", "wbr"})


def build(dest: Path) -> Path:
    """Build the site into ``dest`` with ``mkdocs build --strict``; fail with its log."""
    pytest.importorskip("mkdocs", reason="the docs tooling is in the dev extra")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(dest)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    if proc.returncode != 0:
        pytest.fail(f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}")
    return dest


@dataclass
class Text:
    """A run of prose text and the element it sits in."""

    text: str
    tag: str


class Page(HTMLParser):
    """One built page: its ids, links, images, table of contents and article prose."""

    def __init__(self, path: Path) -> None:
        super().__init__(convert_charrefs=True)
        self.path = path
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.images: list[str] = []
        self.linked_images: list[str] = []
        self.resources: list[str] = []
        self.toc: list[str] = []
        self.h2_ids: list[str] = []
        self.prose: list[Text] = []
        self._stack: list[tuple[str, dict[str, str]]] = []
        self._toc_link: list[str] | None = None
        self.feed(self.path.read_text(encoding="utf-8"))
        self.close()

    def _inside(self, predicate: object) -> bool:
        return any(predicate(tag, attrs) for tag, attrs in self._stack)  # type: ignore[operator]

    def handle_starttag(self, tag: str, attrs_list: list[tuple[str, str | None]]) -> None:
        attrs = {name: value or "" for name, value in attrs_list}
        for key in ("id", "name") if tag == "a" else ("id",):
            if attrs.get(key):
                self.ids.add(attrs[key])
        if tag == "h2" and attrs.get("id") and self._in_article():
            self.h2_ids.append(attrs["id"])
        if tag == "a" and "href" in attrs:
            self.links.append(attrs["href"])
            if self._in_toc():
                self._toc_link = []
        elif tag == "img" and "src" in attrs:
            self.images.append(attrs["src"])
            if self._stack and self._stack[-1][0] == "a":
                self.linked_images.append(attrs["src"])
        elif tag in ("script", "iframe") and attrs.get("src"):
            self.resources.append(attrs["src"])
        elif tag == "link" and attrs.get("href") and "stylesheet" in attrs.get("rel", ""):
            self.resources.append(attrs["href"])
        if tag not in VOID:
            self._stack.append((tag, attrs))

    def handle_endtag(self, tag: str) -> None:
        if tag == "a" and self._toc_link is not None:
            self.toc.append(" ".join("".join(self._toc_link).split()))
            self._toc_link = None
        for i in range(len(self._stack) - 1, -1, -1):
            if self._stack[i][0] == tag:
                del self._stack[i:]
                break

    def handle_data(self, data: str) -> None:
        if self._toc_link is not None:
            self._toc_link.append(data)
        if self._in_article() and not self._inside(lambda tag, _: tag in CODE):
            self.prose.append(Text(data, self._stack[-1][0] if self._stack else ""))

    def _in_toc(self) -> bool:
        """Inside the page's table of contents (Material: the secondary navigation)."""
        return self._inside(lambda tag, attrs: tag == "nav"
                            and "md-nav--secondary" in attrs.get("class", "").split())

    def _in_article(self) -> bool:
        return self._inside(lambda tag, attrs: tag == "article")


def pages(site: Path) -> dict[Path, Page]:
    """Every built HTML page, by its path inside the site."""
    return {p.relative_to(site): Page(p) for p in sorted(site.rglob("*.html"))}


def source_of(page: Path) -> Path | None:
    """The Markdown source of a built page (``x/index.html`` <- ``docs/x.md``)."""
    parts = page.parts
    if parts[-1] != "index.html":
        return None
    candidates = [DOCS.joinpath(*parts[:-1]).with_suffix(".md"),
                  DOCS.joinpath(*parts[:-1], "index.md")] if parts[:-1] else [DOCS / "index.md"]
    return next((c for c in candidates if c.is_file()), None)
