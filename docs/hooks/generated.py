"""The docs site's build hook (mkdocs.yml `hooks:`): the parts of pages written from the repository.

A page asks for generated text with a line of its own, `<!-- generated: NAME [ARGUMENT] -->`, and
may follow it with `> ` lines for readers of the raw file (on GitHub); the site replaces both:

    config-reference    every config key from rlhf/config.py (docs/hooks/reference.py)
    protocols           the Protocols of rlhf/protocols.py
    recipes             the recipes of configs/, by GPU count (docs/hooks/recipes_table.py)
    include PATH        a Markdown file of the repository outside docs/ (RELIABILITY.md), its title
                        dropped and its links made to hold inside the site
    design-notes        the pages under docs/design/, which on_config also adds to the nav

An unknown name stops the build. The pages are rebuilt from the code at every build, so a key, a
recipe or a promise added there shows here without anyone editing the docs.
"""

from __future__ import annotations

import posixpath
import re
import sys
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # `rlhf`, which reads the recipes, without an install

import recipes_table  # noqa: E402
import reference  # noqa: E402

MARKER = re.compile(r"^<!-- generated: ([\w-]+)(?: (\S+))? -->\n?(?:> .*(?:\n|$))*", re.MULTILINE)
LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")
DESIGN = "Design notes"
WATCHED = ("rlhf/config.py", "rlhf/protocols.py", "configs", "RELIABILITY.md", "benchmarks/README.md")


def site_link(match: re.Match[str], source: Path, page_dir: str, docs: Path) -> str:
    """A link of an included file, seen from the page: into docs/ it is kept (made relative to the
    page), anywhere else it becomes the path in code, which the site cannot link to."""
    bang, text, target = match.groups()
    if re.match(r"[a-z]+:|#", target):
        return match[0]
    path, _, anchor = target.partition("#")
    resolved = (source.parent / path).resolve()
    if resolved.is_relative_to(docs):
        local = posixpath.relpath(resolved.relative_to(docs).as_posix(), page_dir or ".")
        return f"{bang}[{text}]({local}{'#' + anchor if anchor else ''})"
    shown = resolved.relative_to(ROOT).as_posix() if resolved.is_relative_to(ROOT) else path
    return text if bang else f"{text} (`{shown}`)"


def include(argument: str | None, page: Page, docs: Path) -> str:
    """The file's text less its first `# ` title, with links outside fenced code made to hold."""
    if not argument or not (ROOT / argument).is_file():
        raise PluginError(f"{page.file.src_uri}: `include` needs a file of the repository, got {argument!r}")
    source, page_dir = ROOT / argument, posixpath.dirname(page.file.src_uri)
    out, fenced, titled = [], False, False
    for line in source.read_text().splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced and not titled and line.startswith("# "):
            titled = True
            continue
        elif not fenced:
            line = LINK.sub(lambda m: site_link(m, source, page_dir, docs), line)
        out.append(line)
    return "\n".join(out)


def design_notes(docs: Path) -> list[str]:
    """The design pages, as paths inside docs/ (`design/index.md`, the section's own page, left out)."""
    pages = sorted((docs / "design").glob("*.md"))
    return [p.relative_to(docs).as_posix() for p in pages if p.name != "index.md"]


def design_list(page: Page, docs: Path) -> str:
    page_dir = posixpath.dirname(page.file.src_uri) or "."
    notes = design_notes(docs)
    if not notes:
        return "No design note has moved here yet: each module's docstring still carries its choices."
    return "\n".join(f"- [{title(docs / n)}]({posixpath.relpath(n, page_dir)})" for n in notes)


def title(page: Path) -> str:
    """A page's `# ` heading, or its file name."""
    first = next((line[2:].strip() for line in page.read_text().splitlines() if line.startswith("# ")), None)
    return first or page.stem.replace("_", " ")


def generated(name: str, argument: str | None, page: Page, docs: Path) -> str:
    if name == "config-reference":
        return reference.config_reference(ROOT / "rlhf" / "config.py")
    if name == "protocols":
        return reference.protocol_reference(ROOT / "rlhf" / "protocols.py")
    if name == "recipes":
        return recipes_table.recipes_page(ROOT)
    if name == "include":
        return include(argument, page, docs)
    if name == "design-notes":
        return design_list(page, docs)
    raise PluginError(f"{page.file.src_uri}: unknown generated section {name!r}")


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    """Every page under docs/design/ joins the nav's design section, in name order."""
    for entry in config.nav or []:
        if isinstance(entry, dict) and isinstance(entry.get(DESIGN), list):
            listed = set(map(str, entry[DESIGN]))
            entry[DESIGN] += [n for n in design_notes(Path(config.docs_dir)) if n not in listed]
    return config


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: object) -> str:
    docs = Path(config.docs_dir).resolve()
    return MARKER.sub(lambda m: generated(m[1], m[2], page, docs) + "\n", markdown)


def on_serve(server: object, config: MkDocsConfig, builder: object) -> object:
    """`mkdocs serve` rebuilds when a source of a generated section changes."""
    for path in WATCHED:
        server.watch(str(ROOT / path))  # type: ignore[attr-defined]
    return server
