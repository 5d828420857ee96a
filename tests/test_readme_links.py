"""Every relative link in README.md and docs/**/*.md points to a file that exists, and every
``#anchor`` to a heading of its target, by GitHub's heading ids (which mkdocs.yml's slugify
reproduces, so one link works on GitHub and in the built site)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import ROOT

FENCE = re.compile(r"^ {0,4}(`{3,}|~{3,})")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
# [text](target) and ![alt](target); the text may span lines; an optional "title" after the target.
LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*:|//)")


def closes(marker: str, fence: str, line: str) -> bool:
    """Whether a fence line closes the open block: same character, at least as long, nothing after."""
    return marker[0] == fence[0] and len(marker) >= len(fence) and not line.strip()[len(marker) :]


def without_code(text: str) -> str:
    """The Markdown with fenced blocks blanked (line numbers kept) and inline code spans removed."""
    out, fence = [], ""
    for line in text.splitlines():
        m = FENCE.match(line)
        if fence:
            if m and closes(m.group(1), fence, line):
                fence = ""
            out.append("")
        elif m:
            fence = m.group(1)
            out.append("")
        else:
            out.append(line)
    return CODE_SPAN.sub("code", "\n".join(out))


def slug(heading: str) -> str:
    """GitHub's heading id: the heading's text, lowercased, punctuation except - and _ dropped,
    every space a hyphen (runs are not collapsed)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The ids of every heading in a Markdown file (duplicates get -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    fence = ""
    for line in path.read_text(encoding="utf-8").splitlines():
        m = FENCE.match(line)
        if fence:
            if m and closes(m.group(1), fence, line):
                fence = ""
            continue
        if m:
            fence = m.group(1)
            continue
        h = HEADING.match(line)
        if h:
            base = slug(h.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(md: Path) -> list[str]:
    """``file:line: target (why)`` for each relative link of ``md`` that does not resolve."""
    text = without_code(md.read_text(encoding="utf-8"))
    problems = []
    for m in LINK.finditer(text):
        target = m.group(2)
        if not target or SCHEME.match(target):
            continue
        line = text.count("\n", 0, m.start(2)) + 1
        name = md.relative_to(ROOT) if md.is_relative_to(ROOT) else md.name
        where = f"{name}:{line}: {target}"
        file_part, _, anchor = target.partition("#")
        dest = (md.parent / file_part).resolve() if file_part else md
        if not dest.exists():
            problems.append(f"{where} (no such file: {dest})")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where} (no heading with id '{anchor}' in {dest.name})")
        elif anchor and dest.suffix != ".md":
            problems.append(f"{where} (an anchor into a file that is not Markdown)")
    return problems


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("md", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(md: Path):
    assert broken_links(md) == []


def test_the_readme_links_into_the_docs():
    links = [m.group(2) for m in LINK.finditer(without_code((ROOT / "README.md").read_text()))]
    assert any(t.startswith("docs/") and t.endswith(".md") for t in links)
    assert "docs/reference/config.md" in links


def test_the_checker_finds_broken_files_and_anchors_and_ignores_code(tmp_path: Path):
    (tmp_path / "b.md").write_text("# Tool calling (`env=tools`)\n\n## Weights & Biases\n\n## A\n\n## A\n")
    (tmp_path / "a.md").write_text(
        "See [b](b.md#tool-calling-envtools), [w](b.md#weights--biases), [dup](b.md#a-1),\n"
        "[self](#top), [gone](c.md), [bad](b.md#weights-biases), [web](https://x.org/#y),\n"
        "[two\nlines](b.md#nope) and `[code](missing.md)`.\n\n"
        "```\n[fenced](missing.md)\n# not a heading\n```\n\n# Top\n"
    )
    problems = broken_links(tmp_path / "a.md")
    assert [p.split(": ", 1)[1].split(" (")[0] for p in problems] == [
        "c.md",
        "b.md#weights-biases",
        "b.md#nope",
    ]
    assert anchors(tmp_path / "b.md") == {"tool-calling-envtools", "weights--biases", "a", "a-1"}


def test_the_architecture_page_names_every_package_and_file():
    """docs/architecture.md stays true to the code: every folder of the package and every
    module in it is named on the page."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    package = ROOT / "rlhf_lightning"
    missing = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        if "assets" in rel.parts or (path.name == "__init__.py" and len(rel.parts) > 1):
            continue
        if path.stem not in text and rel.as_posix() not in text:
            missing.append(rel.as_posix())
    for folder in sorted(p for p in package.iterdir() if p.is_dir() and not p.name.startswith("__")):
        if f"{folder.name}/" not in text:
            missing.append(f"{folder.name}/")
    assert not missing, f"docs/architecture.md does not name: {missing}"
