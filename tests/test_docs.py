"""README.md and docs/*.md: every ```python block runs as written, pasted alone, and every link points somewhere.

Each block runs in a fresh Python process on the CPU (no state from the test process: no x64, no earlier block's
names), so a block that forgets an import or leans on an earlier block fails here with its file and number.  A
block that cannot run on a CPU in CI is either not a ```python block (``bash``, ``text``) or follows a
``<!-- no-run: reason -->`` comment on the line before its fence.  The blocks assert what they claim (forms
agree, continuation is exact), so a wrong claim fails too.  Running them takes about 75 s of CPU, so that test is
marked slow (``python -m pytest tests/test_docs.py`` runs it); the link, image and wording checks run in CI.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")
NO_RUN = re.compile(r"^<!--\s*no-run:\s*\S.*-->\s*$")
TIMEOUT_S = 300


def code_blocks(text: str):
    """``(language, first line number, code, no-run reason or None)`` for every fenced block of ``text``."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start = i
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        if j == len(lines):
            raise ValueError(f"line {start + 1}: a code fence is never closed")
        before = next((lines[p].strip() for p in range(start - 1, -1, -1) if lines[p].strip()), "")
        reason = before if NO_RUN.match(before) else None
        blocks.append((m.group(1), start + 1, "\n".join(lines[start + 1:j]) + "\n", reason))
        i = j + 1
    return blocks


def python_blocks():
    for path in DOCS:
        number = 0
        for lang, line, code, reason in code_blocks(path.read_text()):
            if lang != "python":
                continue
            number += 1
            name = f"{path.relative_to(ROOT)}#{number}"
            marks = [pytest.mark.skip(reason=reason)] if reason else []
            yield pytest.param(path, number, line, code, id=name, marks=marks)


def test_the_parser_sees_fences_and_no_run_comments():
    text = "x\n```python\na = 1\n```\n\n<!-- no-run: needs a GPU -->\n```python\nb\n```\n```bash\nls\n```\n"
    blocks = code_blocks(text)
    assert [(b[0], b[1], b[3]) for b in blocks] == [("python", 2, None), ("python", 7, "<!-- no-run: needs a GPU -->"),
                                                   ("bash", 10, None)]
    assert blocks[0][2] == "a = 1\n"
    with pytest.raises(ValueError, match="never closed"):
        code_blocks("```python\na = 1\n")


def test_the_docs_have_python_blocks():
    assert sum(1 for _ in python_blocks()) >= 5


@pytest.mark.slow  # ~75 s of CPU for all the blocks (a fresh interpreter and jax's compilations each)
@pytest.mark.parametrize("path, number, line, code", list(python_blocks()))
def test_python_block_runs(path, number, line, code, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_PYTHON"))}
    env["JAX_PLATFORMS"] = "cpu"
    script = tmp_path / f"block{number}.py"
    script.write_text(code)
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=TIMEOUT_S)
    where = f"{path.relative_to(ROOT)}, python block {number} (line {line})"
    assert result.returncode == 0, f"{where} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"


LINK = re.compile(r"(!?)\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    lines, inside = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            inside = not inside
        elif not inside and line.startswith("#"):
            lines.append(slug(line.lstrip("#")))
    return set(lines)


def test_slug_follows_github():
    assert slug("## Per-shard kernels (shard_map) and the XLA crash".lstrip("#")) == \
        "per-shard-kernels-shard_map-and-the-xla-crash"
    assert slug(" 1. Variable-length addition") == "1-variable-length-addition"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_and_images_resolve(path):
    """Relative links and images point at files of the repository, and their #anchors at headings there."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    bad = []
    for image, target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s) and other schemes
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists():
            bad.append(f"{target}: no file {resolved}")
        elif anchor and anchor not in anchors(resolved):
            bad.append(f"{target}: no heading with anchor #{anchor} in {resolved.name}")
    assert not bad, f"{path.relative_to(ROOT)}: " + "; ".join(bad)


def test_every_image_is_shown():
    shown = {(p.parent / t).resolve() for p in DOCS for i, t in LINK.findall(p.read_text()) if i}
    unused = [str(f.relative_to(ROOT)) for f in sorted((ROOT / "docs" / "img").glob("*")) if f.resolve() not in shown]
    assert not unused, f"images no document shows: {unused}"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_history_and_no_outside_sources(path):
    """The docs describe the product as it is (no session or lease labels) and cite nothing outside the
    repository (the spec the project started from is not in it)."""
    text = path.read_text()
    found = [m.group(0) for m in re.finditer(r"\bSPEC\b|SPEC\.md|\bsessions?\b|\bnext\d+\b|\bH200 run\b", text)]
    assert not found, f"{path.relative_to(ROOT)}: {found}"
