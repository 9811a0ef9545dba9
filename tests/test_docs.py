"""The docs hold together: every file a module cites exists (and every section it names), every link of the README
and of docs/ resolves (its anchor too), and the README stays short. Read from the files, nothing imported."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 300
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# a cited path: docs/..., tools/..., or a name ending in .md (not inside a longer path or an address)
CITED = re.compile(r"(?<![\w./:-])((?:docs|tools)/[\w./-]*\w|[\w./-]*\w\.md)\b")
# a section cited after its file: docs/x.md ("Name") or docs/x.md, "Name"
SECTION = re.compile(r"([\w./-]*\w\.md)`?(?: \(|, )[\"“]([^\"”]+)[\"”]")
LINK = re.compile(r"\]\(([^)\s]+)\)")
# a path of the repository written in backticks in a doc: `tools/bench_train.py`, `trainer/model/`
REPO_PATH = re.compile(r"`((?:docs|tools|tests|tiermem|trainer|configs|data|models|\.ci)/[\w./-]*)`")


def cited_by_code() -> list[tuple[Path, int, str]]:
    """Every path that a module, tool or test cites (in a docstring, a comment or a message): file, line, path."""
    files = [p for top in ("tiermem", "trainer", "tools", "tests") for p in sorted((ROOT / top).rglob("*"))
             if p.suffix in (".py", ".sh") and p != Path(__file__).resolve()]  # (not this file's examples)
    return [(p, i, m.group(1)) for p in files for i, line in enumerate(p.read_text().splitlines(), 1)
            for m in CITED.finditer(line)]


def prose(doc: Path) -> str:
    """A doc's text without its fenced code blocks (whose ``#`` lines are comments, not headings)."""
    return re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.M | re.S)


def headings(doc: Path) -> list[str]:
    return re.findall(r"^#+ (.+)$", prose(doc), re.M)


def sections(doc: Path) -> list[str]:
    """The names a doc's sections go by: its headings and the bold titles of its bullets and paragraphs."""
    return [*headings(doc), *re.findall(r"^(?:- )?\*\*(.+?)\*\*", prose(doc), re.M)]


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_file_the_code_cites_exists():
    missing = [f"{p.relative_to(ROOT)}:{i} cites {path}" for p, i, path in cited_by_code()
               if not (ROOT / path).exists()]
    assert not missing, "\n".join(missing)


def test_every_section_the_code_and_docs_cite_exists():
    files = [p for top in ("tiermem", "trainer", "tools", "tests") for p in (ROOT / top).rglob("*.py")
             if p != Path(__file__).resolve()] + DOCS
    broken = []
    for p in files:
        for doc, name in SECTION.findall(p.read_text()):
            target = ROOT / doc if (ROOT / doc).exists() else ROOT / "docs" / Path(doc).name
            if not target.exists() or not any(s.startswith(name) for s in sections(target)):
                broken.append(f"{p.relative_to(ROOT)} cites {doc}, \"{name}\"")
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(doc):
    """Relative links reach a file of the repository, and an anchor a heading of it."""
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):  # (an address outside the repository)
            continue
        path, _, frag = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif frag and dest.suffix == ".md" and frag not in {anchor(h) for h in headings(dest)}:
            broken.append(f"{target}: no such heading")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_a_doc_names_exists(doc):
    missing = [p for p in REPO_PATH.findall(doc.read_text()) if "*" not in p and not (ROOT / p).exists()]
    assert not missing, f"{doc.relative_to(ROOT)} names {missing}"


def test_the_readme_is_under_300_lines():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n < README_MAX_LINES, f"README.md has {n} lines: move detail into docs/"


def test_the_checks_would_catch_a_break(tmp_path):
    text = "DESIGN.md and docs/x.md, not ../shared/tools/a.sh, https://a.io/b.md"
    assert [m.group(1) for m in CITED.finditer(text)] == ["DESIGN.md", "docs/x.md"]
    assert LINK.findall("[a](docs/a.md#b) and [c](https://x.io)") == ["docs/a.md#b", "https://x.io"]
    assert SECTION.findall('docs/architecture.md ("Many hosts"); docs/service.md, "Liveness"') == [
        ("docs/architecture.md", "Many hosts"), ("docs/service.md", "Liveness")]
    assert anchor("Design choices: the runs behind them") == "design-choices-the-runs-behind-them"
    doc = tmp_path / "d.md"
    doc.write_text("# Title\n\n```bash\n# a comment\n```\n\n## Part\n")
    assert headings(doc) == ["Title", "Part"]  # (not the comments of its code blocks)
    assert anchor("How to add a tier, a model family or a cost-model term") == \
        "how-to-add-a-tier-a-model-family-or-a-cost-model-term"


def test_the_architecture_names_every_module():
    """docs/architecture.md's "The parts" names every module of tiermem and the trainer: a new module gets its
    line there."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    parts = text[text.index("## The parts"):text.index("## What each part may import")]
    missing = [str(p.relative_to(ROOT)) for top in ("tiermem", "trainer") for p in sorted((ROOT / top).rglob("*.py"))
               if p.stem not in ("__init__", "__main__") and not re.search(rf"\b{re.escape(p.stem)}\b", parts)]
    assert not missing, f"docs/architecture.md (The parts) does not name {missing}"
