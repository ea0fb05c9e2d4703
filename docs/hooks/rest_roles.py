"""reST cross-reference roles (``:class:`~pkg.Name```) rendered as links on the site.

Many docstrings (and perhaps a guide) are written with Sphinx roles; Markdown shows them
as literal text. They are converted while the site is built, never in the sources, so a
docstring may be written either way:

- ``RestRoles``, a Griffe extension (``mkdocs.yml``: mkdocstrings' python handler,
  ``extensions:``), rewrites the docstrings once the package is loaded. A role's target
  is resolved the way Python would from the docstring's own scope (members, imports,
  enclosing class and module, inherited members; ``.name`` relative to the enclosing
  scopes), then written as an optional mkdocs-autorefs cross-reference to the object's
  canonical path: a link when a reference page renders the object, inline code when
  none does (an internal module, a member without a docstring). A target that is not an
  object of the package (another library, an ambiguous bare name) becomes inline code:
  never a link that leads nowhere, never a raw role.
- ``on_page_markdown``, an MkDocs hook (``mkdocs.yml``: ``hooks:``), does the same in
  the guides, where there is no scope: targets must be fully qualified there, and
  ``mkdocs build --strict`` fails on one that does not resolve.

The title follows Sphinx: ``~a.b.C`` shows ``C``, ``a.b.C`` shows ``a.b.C``,
``Title <a.b.C>`` shows ``Title``, a function or method gets ``()``, ``!a.b.C`` is not
linked. Fenced code blocks are left alone.
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable, Iterator
from typing import Any

import griffe

ROLE = re.compile(
    r":(?:py:)?(?P<role>class|meth|func|attr|mod|exc|data|obj|const|type):"
    r"`(?P<body>[^`]+)`"
)
FENCE = re.compile(r"^\s*(```|~~~)")
CALLABLE_ROLES = frozenset({"meth", "func"})


class Role:
    """One role occurrence: its kind, the target written, and the title to show."""

    def __init__(self, role: str, body: str) -> None:
        body = " ".join(body.split())  # a role broken across docstring lines
        explicit = re.fullmatch(r"(?P<title>.*?)\s*<(?P<target>[^<>]+)>", body)
        self.role = role
        self.link = True
        if explicit:
            self.title = explicit["title"]
            target = explicit["target"]
        else:
            target = body
            self.title = ""
        target = target.replace(" ", "")  # a dotted name has no spaces
        if target.startswith("!"):
            self.link = False
            target = target[1:]
        short = target.startswith("~")
        self.target = target.lstrip("~")
        if not self.title:
            shown = self.target.rsplit(".", 1)[-1] if short else self.target.lstrip(".")
            if role in CALLABLE_ROLES and not shown.endswith(")"):
                shown += "()"
            self.title = shown

    def code(self) -> str:
        return f"`{self.title}`"

    def crossref(self, path: str) -> str:
        """An autorefs cross-reference: ``mkdocs build --strict`` fails if it leads nowhere."""
        return f"[`{self.title}`][{path}]"

    def optional_crossref(self, path: str) -> str:
        """A link if ``path`` is rendered on some page, else inline code (autorefs' marker)."""
        return (f'<autoref identifier="{html.escape(path)}" optional>'
                f"<code>{html.escape(self.title)}</code></autoref>")


def rewrite(text: str, convert: Callable[[Role], str]) -> str:
    """``text`` with every role outside fenced code replaced by ``convert(role)``."""
    out: list[str] = []
    chunk: list[str] = []
    fence: str | None = None

    def flush() -> None:
        if chunk:
            out.append(ROLE.sub(lambda m: convert(Role(m["role"], m["body"])), "".join(chunk)))
            chunk.clear()

    for line in text.splitlines(keepends=True):
        opened = FENCE.match(line)
        if fence is None and opened:
            flush()
            fence = opened.group(1)
            out.append(line)
        elif fence is not None:
            out.append(line)
            if line.strip().startswith(fence):
                fence = None
        else:
            chunk.append(line)
    flush()
    return "".join(out)


# -- Griffe extension: docstrings -------------------------------------------------------


def _walk(obj: griffe.Object) -> Iterator[griffe.Object]:
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _walk(member)  # type: ignore[arg-type]


def _scopes(obj: griffe.Object) -> Iterator[griffe.Object]:
    scope: griffe.Object | None = obj
    while scope is not None:
        yield scope
        scope = scope.parent


class RestRoles(griffe.Extension):
    """Rewrite reST roles in the package's docstrings into autorefs cross-references."""

    def __init__(self) -> None:
        super().__init__()
        self.linked = 0
        self.unlinked: list[tuple[str, str]] = []

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        collection = loader.modules_collection
        for obj in _walk(pkg):
            docstring = obj.docstring
            if docstring is None or ":`" not in docstring.value:
                continue

            def convert(role: Role, obj: griffe.Object = obj) -> str:
                path = self._resolve(role, obj, collection) if role.link else None
                if path is None:
                    if role.link:
                        self.unlinked.append((obj.path, role.target))
                    return role.code()
                self.linked += 1
                return role.optional_crossref(path)

            docstring.value = rewrite(docstring.value, convert)

    @staticmethod
    def _resolve(
        role: Role, obj: griffe.Object, collection: griffe.ModulesCollection
    ) -> str | None:
        """The canonical path of the package's object ``role`` names, if there is one."""
        names = role.target.lstrip(".").split(".")
        if role.target.startswith("."):  # relative: a member of an enclosing scope
            starts = [scope for scope in _scopes(obj) if names[0] in _members(scope)]
        else:  # a name visible in the docstring's scope, else a full path
            starts = [scope for scope in _scopes(obj) if names[0] in _members(scope)][:1]
            if names[0] in collection.members:
                starts.append(collection)  # type: ignore[arg-type]
        for start in starts:
            found: Any = start
            try:
                for name in names:
                    found = _members(found)[name]
                    if found.is_alias:
                        found = found.final_target
                return str(found.canonical_path)
            except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
                continue
        return None


def _members(obj: Any) -> dict[str, Any]:
    """Members reachable by attribute access: a class's inherited ones included."""
    if getattr(obj, "is_class", False):
        try:
            return dict(obj.all_members)
        except (griffe.AliasResolutionError, griffe.CyclicAliasError):
            pass
    return dict(obj.members)


# -- MkDocs hook: guides ----------------------------------------------------------------


def _guide_crossref(role: Role) -> str:
    if not role.link:
        return role.code()
    return role.crossref(role.target.lstrip("."))


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """Roles in a guide's Markdown become cross-references to their (qualified) targets."""
    return rewrite(markdown, _guide_crossref)
