"""The documentation site as a reader gets it: built with ``mkdocs build --strict``, then
read back as HTML.

``--strict`` alone misses what renders wrongly but builds: a code span broken so that a
line starts with ``<group>`` (Markdown then reads the rest of the page as raw HTML), reST
roles shown as literal text, a heading missing from the table of contents. These checks
read the built pages: no raw reST role and no raw Markdown outside code, every ``##``
heading in its page's table of contents, every image present, every internal link and
anchor resolving. The reST-role converter (``docs/hooks/rest_roles.py``) is tested on
its own too.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from urllib.parse import unquote, urlsplit

import pytest

from docs_site import DOCS, REPO, Page, build, pages, source_of

ROLE_MARKER = re.compile(r"(?<![\w:]):(?:py:)?(?:class|meth|func|attr|mod|exc|data|obj|const):")
RAW_MARKDOWN = {
    "bold or italic marker **": re.compile(r"\*\*"),
    "code fence ```": re.compile(r"```"),
    "heading marker # at a line start": re.compile(r"\n[ \t]*#{1,6} \S"),
    "list marker at a line start": re.compile(r"\n[ \t]*[-*+] \S"),
    "link or reference brackets": re.compile(r"\]\(|\]\["),
}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("site") / "site")


@pytest.fixture(scope="module")
def built(site: Path) -> dict[Path, Page]:
    found = pages(site)
    assert Path("index.html") in found
    return found


def _article(page: Page) -> str:
    return "".join(text.text for text in page.prose)


def test_no_raw_rest_roles(built: dict[Path, Page]) -> None:
    """reST roles (``:class:`~pkg.Name```) render as links or code, never as text."""
    raw = {
        str(path): sorted({m.group(0) for m in ROLE_MARKER.finditer(_article(page))})
        for path, page in built.items()
        if ROLE_MARKER.search(_article(page))
    }
    assert raw == {}
    leftover = [str(path) for path, page in built.items()
                if "autoref" in page.path.read_text(encoding="utf-8").replace("autorefs", "")]
    assert leftover == []  # every cross-reference marker was resolved or dropped


def test_no_raw_markdown_outside_code(built: dict[Path, Page]) -> None:
    """No Markdown marker shows as text: the page was rendered, not passed through."""
    raw: dict[str, list[str]] = {}
    for path, page in built.items():
        for text in page.prose:
            for what, pattern in RAW_MARKDOWN.items():
                if pattern.search(text.text):
                    raw.setdefault(str(path), []).append(
                        f"{what} in <{text.tag}>: {text.text.strip()[:80]!r}")
    assert raw == {}


def _headings(markdown: str, level: int = 2) -> list[str]:
    """The ``##`` headings of a Markdown page, fenced code left out."""
    found: list[str] = []
    fence: str | None = None
    for line in markdown.splitlines():
        opened = re.match(r"\s*(```|~~~)", line)
        if fence is None and opened:
            fence = opened.group(1)
        elif fence is not None:
            if line.strip().startswith(fence):
                fence = None
        elif re.match("#" * level + r" \S", line):
            found.append(line[level + 1:].strip().rstrip("#").strip())
    return found


def _normal(title: str) -> str:
    """A heading as its table-of-contents entry shows it, for comparison."""
    title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)  # [text](url) -> text
    return re.sub(r"[^a-z0-9@]+", "", title.lower())


def test_every_section_heading_is_in_its_table_of_contents(built: dict[Path, Page]) -> None:
    """Each ``##`` heading of a page's source, and each ``<h2>`` of the built page, is
    an entry of that page's table of contents."""
    checked = 0
    missing: dict[str, list[str]] = {}
    for path, page in built.items():
        toc = {_normal(entry) for entry in page.toc}
        source = source_of(path)
        if source is not None:
            for heading in _headings(source.read_text(encoding="utf-8")):
                checked += 1
                if _normal(heading) not in toc:
                    missing.setdefault(str(path), []).append(heading)
        toc_targets = {link[1:] for link in page.links if link.startswith("#")}
        for anchor in page.h2_ids:
            checked += 1
            if anchor not in toc_targets:
                missing.setdefault(str(path), []).append(f"<h2 id={anchor}>")
    assert checked > 50
    assert missing == {}


def _local_target(page: Path, site: Path, ref: str) -> tuple[Path, str] | None:
    """The file and anchor a local reference points at; None for an external one."""
    parts = urlsplit(ref)
    if parts.scheme or parts.netloc or ref.startswith(("mailto:", "javascript:", "data:")):
        return None
    if not parts.path:
        return site / page, unquote(parts.fragment)
    if parts.path.startswith("/"):  # 404.html: absolute, the site served at its root
        target = site / unquote(parts.path).lstrip("/")
    else:
        target = (site / page).parent / unquote(parts.path)
    if ref.endswith("/") or target.is_dir():
        target = target / "index.html"
    return target, unquote(parts.fragment)


def test_every_image_and_resource_exists(site: Path, built: dict[Path, Page]) -> None:
    images = 0
    broken: list[str] = []
    for path, page in built.items():
        for ref in [*page.images, *page.resources]:
            target = _local_target(path, site, ref)
            if target is None:
                continue
            images += ref in page.images
            if not target[0].resolve().is_relative_to(site.resolve()) or not target[0].is_file():
                broken.append(f"{path}: {ref}")
    assert images > 0
    assert broken == []


def test_every_internal_link_and_anchor_resolves(site: Path, built: dict[Path, Page]) -> None:
    links = 0
    broken: list[str] = []
    for path, page in built.items():
        for ref in page.links:
            target = _local_target(path, site, ref)
            if target is None:
                continue
            links += 1
            file, anchor = target
            if not file.resolve().is_relative_to(site.resolve()) or not file.is_file():
                broken.append(f"{path}: {ref} (no such file)")
                continue
            if anchor and file.suffix == ".html":
                ids = built[file.resolve().relative_to(site.resolve())].ids
                if anchor not in ids:
                    broken.append(f"{path}: {ref} (no anchor {anchor!r})")
    assert links > 100
    assert broken == []


def test_api_reference_links_its_cross_references(built: dict[Path, Page]) -> None:
    """The docstrings' roles became links between the reference pages."""
    page = built[Path("reference/aio/index.html")]
    assert any(link.endswith("#msgpatterns.aio.base.AsyncBroker") for link in page.links)
    assert any("reference/consumer/#msgpatterns.consumer.Consumer" in link
               or link.startswith("../consumer/#msgpatterns.consumer.Consumer")
               for link in page.links)


PUBLIC_PACKAGES = ("msgpatterns", "msgpatterns.aio", "msgpatterns.batching",
                   "msgpatterns.brokers", "msgpatterns.brokers.admin",
                   "msgpatterns.idempotency", "msgpatterns.integrations",
                   "msgpatterns.observability", "msgpatterns.ordering", "msgpatterns.raw",
                   "msgpatterns.spark", "msgpatterns.testing")


def test_every_exported_name_has_an_api_reference_entry(
    site: Path, built: dict[Path, Page],
) -> None:
    """Each name a public package exports (its ``__all__``) is documented on a reference
    page, under any of its import paths: a role naming it can then link to it."""
    griffe = pytest.importorskip("griffe")
    package = griffe.load("msgpatterns", search_paths=[str(REPO / "src")],
                          resolve_aliases=True, resolve_external=False)
    collection = package.modules_collection
    documented: set[str] = set()
    for path, page in built.items():
        if path.parts[0] != "reference":
            continue
        for anchor in page.ids:
            try:
                documented.add(collection[anchor].canonical_path)
            except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
                continue
    missing: list[str] = []
    for name in PUBLIC_PACKAGES:
        module = collection[name]
        for export in module.exports or ():
            try:
                canonical = module[str(export)].canonical_path
            except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
                canonical = f"{name}.{export}"
            if canonical not in documented:
                missing.append(f"{name}.{export}")
    assert len(documented) > 100
    assert missing == []


def test_benchmark_plots_are_svgs_that_open_full_size(built: dict[Path, Page]) -> None:
    """One plot per group, drawn as SVG (sharp at any width), each a link to itself."""
    page = built[Path("benchmarks/index.html")]
    plots = [src for src in page.images if "benchmarks/" in src]
    assert len(plots) >= 5
    assert all(src.endswith(".svg") for src in plots)
    assert sorted(page.linked_images) == sorted(plots)
    assert all(src in page.links for src in plots)


def test_integrations_page_renders_past_the_dead_letter_paragraph(
    built: dict[Path, Page],
) -> None:
    """docs/integrations.md once broke a code span so that a line began with ``<group>``:
    everything after it (the Celery section included) rendered as literal text."""
    page = built[Path("integrations/index.html")]
    entries = {_normal(entry) for entry in page.toc}
    assert {_normal("Celery"), _normal("Failure windows (exact)")} <= entries


# -- the reST-role converter on its own ---------------------------------------------


def _hook() -> ModuleType:
    path = DOCS / "hooks" / "rest_roles.py"
    spec = importlib.util.spec_from_file_location("msgpatterns_docs_rest_roles", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_guide_roles_become_cross_references_and_code_blocks_are_left_alone() -> None:
    hook = _hook()
    markdown = textwrap.dedent("""\
        See :class:`~msgpatterns.Consumer`, :meth:`msgpatterns.Consumer.run`,
        :func:`the decorator <msgpatterns.idempotent>` and :class:`!NotLinked`.

        ```python
        x = ":class:`Untouched`"
        ```
        """)
    out = hook.on_page_markdown(markdown)
    assert "[`Consumer`][msgpatterns.Consumer]" in out
    assert "[`msgpatterns.Consumer.run()`][msgpatterns.Consumer.run]" in out
    assert "[`the decorator`][msgpatterns.idempotent]" in out
    assert "`NotLinked`" in out and "[`NotLinked`]" not in out
    assert 'x = ":class:`Untouched`"' in out


def test_docstring_roles_resolve_in_their_scope(tmp_path: Path) -> None:
    """A role's target is found the way Python would find the name from the docstring:
    members (inherited ones too), imports, enclosing scopes, relative module names; a
    target outside the package becomes inline code."""
    griffe = pytest.importorskip("griffe")
    hook = _hook()
    pkg = tmp_path / "rolepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('"""See :mod:`.base` and :class:`~rolepkg.base.Base`."""\n')
    (pkg / "base.py").write_text(textwrap.dedent('''\
        class Base:
            """A base."""

            def run(self) -> None:
                """Run."""
        '''))
    (pkg / "child.py").write_text(textwrap.dedent('''\
        """Uses :class:`Base` and :class:`sqlalchemy.Table`."""
        from rolepkg.base import Base


        class Child(Base):
            """Calls :meth:`run` (inherited) and :meth:`Base.run`; see :attr:`size`."""

            size = 1
            """The size, linked from :class:`Child`, broken across lines: :meth:`Child.
            run`."""
        '''))
    extension = hook.RestRoles()
    loaded = griffe.load("rolepkg", search_paths=[str(tmp_path)],
                         extensions=griffe.load_extensions(extension))

    def ref(path: str, title: str) -> str:
        return f'<autoref identifier="{path}" optional><code>{title}</code></autoref>'

    assert loaded.docstring.value == (
        f"See {ref('rolepkg.base', 'base')} and {ref('rolepkg.base.Base', 'Base')}.")
    child = loaded["child"]
    assert child.docstring.value == (
        f"Uses {ref('rolepkg.base.Base', 'Base')} and `sqlalchemy.Table`.")
    assert child["Child"].docstring.value == (
        f"Calls {ref('rolepkg.base.Base.run', 'run()')} (inherited) and "
        f"{ref('rolepkg.base.Base.run', 'Base.run()')}; see "
        f"{ref('rolepkg.child.Child.size', 'size')}.")
    assert ref("rolepkg.base.Base.run", "Child.run()") in child["Child.size"].docstring.value
    assert ref("rolepkg.child.Child", "Child") in child["Child.size"].docstring.value
