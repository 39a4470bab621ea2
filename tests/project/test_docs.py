"""The README stays short, every doc link resolves, and every `expertcache` command in a doc's code
blocks names only flags the CLI has (parsed from the CLI's own argparse tree, not a copied list)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from expertcache.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 250
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```(\w*)\s*$")
_FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors for a Markdown file's headings: lower case, punctuation dropped, spaces -> '-'."""
    anchors = set()
    in_code = False
    for line in text.splitlines():
        if _FENCE.match(line):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        title = line.lstrip("#").strip().lower()
        anchors.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title)))
    return anchors


def subcommand_flags() -> dict[tuple[str, ...], set[str]]:
    """Every (sub)command path of the CLI -> the option strings it accepts (with the global ones)."""
    out: dict[tuple[str, ...], set[str]] = {}

    def walk(parser: argparse.ArgumentParser, path: tuple[str, ...], inherited: set[str]) -> None:
        flags = inherited | {s for a in parser._actions for s in a.option_strings}
        out[path] = flags
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    walk(sub, path + (name,), inherited | {"--debug", "--help"})

    walk(build_parser(), (), {"--debug"})
    return out


def doc_commands(text: str) -> list[str]:
    """`expertcache ...` command lines inside fenced code blocks, continuation lines joined."""
    cmds, in_code, current = [], False, None
    for line in text.splitlines():
        if _FENCE.match(line):
            in_code = not in_code
            current = None
            continue
        if not in_code:
            continue
        code = line.split("#", 1)[0] if not line.lstrip().startswith("#") else ""
        stripped = code.strip()
        words = stripped.split()
        if "expertcache" in words:
            current = " ".join(words[words.index("expertcache") :])
            cmds.append(current)
        elif current is not None and line[:1].isspace() and stripped:
            cmds[-1] += " " + stripped  # an indented continuation of the command above
        else:
            current = None
    return cmds


def test_readme_is_short():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (budget {README_MAX_LINES}): move detail to docs/"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_links_resolve(doc: Path):
    text = doc.read_text()
    broken = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http(s):, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(
                f"{target} (no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest})"
            )
        elif anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest.read_text()):
            broken.append(f"{target} (no heading #{anchor} in {dest.name})")
    assert not broken, f"{doc.name}: broken links: {broken}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_commands_use_real_flags(doc: Path):
    known = subcommand_flags()
    bad = []
    for cmd in doc_commands(doc.read_text()):
        words = [w.strip("[]|()") for w in cmd.split()[1:]]
        path: tuple[str, ...] = ()
        for w in words:  # the longest subcommand path the words start with
            if path + (w,) in known:
                path += (w,)
            elif not w.startswith("-") and path:
                break
        for flag in _FLAG.findall(" ".join(words)):
            if flag not in known[path]:
                bad.append(f"`expertcache {' '.join(path)}` has no {flag} (in: {cmd[:80]})")
    assert not bad, f"{doc.name}: {bad}"


def test_the_checks_catch_what_they_claim(tmp_path):
    """The checkers themselves: an invented flag, a missing file and a missing heading are found."""
    known = subcommand_flags()
    assert "--device-memory" in known[("generate",)] and "--no-such-flag" not in known[("generate",)]
    cmds = doc_commands("```bash\nexpertcache generate M --prompt x \\\n    --no-such-flag 3\n```\n")
    assert cmds and "--no-such-flag" in cmds[0]
    assert "the-gpu-path" in heading_anchors("# The GPU path\n")
    assert "not-here" not in heading_anchors("# The GPU path\n```\n# not here\n```\n")


_POINTER = re.compile(r'(docs/[\w-]+\.md), "([^"]+)"')


def code_pointers(root: Path) -> list[tuple[str, str, str]]:
    """(file, doc, heading) for every `docs/NAME.md, "Heading"` in root's Python source, comments joined
    across lines (a figure moved out of a comment leaves such a pointer behind)."""
    found = []
    for f in sorted((root / "expertcache").rglob("*.py")):
        text = re.sub(r"\n[ \t]*#[ \t]*", " ", f.read_text())
        found += [(str(f.relative_to(root)), d, h) for d, h in _POINTER.findall(text)]
    return found


def headings(doc: Path) -> set[str]:
    return {line.lstrip("#").strip() for line in doc.read_text().splitlines() if line.startswith("#")}


def test_code_points_to_doc_sections_that_exist(tmp_path):
    pointers = code_pointers(ROOT)
    assert any(f == "expertcache/kernels/__init__.py" for f, _, _ in pointers)  # the scan sees them
    missing = [f"{f}: {d}, {h!r}" for f, d, h in pointers if h not in headings(ROOT / d)]
    assert not missing, "code points to doc sections that do not exist:\n" + "\n".join(missing)
    # the scanner on a made-up file: a pointer split over two comment lines is found
    (tmp_path / "expertcache").mkdir()
    (tmp_path / "expertcache" / "m.py").write_text('# see docs/x.md, "A long\n    # heading"\nX = 1\n')
    assert code_pointers(tmp_path) == [("expertcache/m.py", "docs/x.md", "A long heading")]
