"""docs/benchmarks.md stays a page to scan: a table of contents that matches its sections,
short paragraphs and list items, and links to notes and images that resolve.

The sections are written by the scripts in benchmarks/; the Keras one
(``keras_step_time``) may not have been written yet, and then only its contents
entry points nowhere.
"""
import os
import re

import pytest

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")
PAGE = os.path.join(DOCS, "benchmarks.md")
KERAS_BEGIN = "<!-- keras_step_time:begin -->"
KERAS_END = "<!-- keras_step_time:end -->"
KERAS_ANCHOR = "keras-fit-step-time-vs-tfdistribute-keras_step_time"
MAX_CHARS = 500

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s+")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped (word characters,
    hyphens and spaces kept), each space a hyphen."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(headings: list) -> list:
    """GitHub's anchors of ``headings`` in order, a repeated one suffixed -1, -2, ..."""
    seen, out = {}, []
    for heading in headings:
        base = github_anchor(heading)
        count = seen.get(base, 0)
        out.append(base if count == 0 else f"{base}-{count}")
        seen[base] = count + 1
    return out


def blocks(text: str) -> list:
    """(kind, text) of each block outside code fences: heading, table, list item, comment or
    paragraph; a list item or paragraph joined into one line."""
    out, paragraph, item, fenced = [], [], None, False

    def flush():
        nonlocal paragraph, item
        if paragraph:
            out.append(("paragraph", " ".join(paragraph)))
        if item is not None:
            out.append(("item", " ".join(item)))
        paragraph, item = [], None

    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith(("```", "~~~")):
            flush()
            fenced = not fenced
            continue
        if fenced:
            continue
        if not stripped:
            flush()
        elif _HEADING.match(stripped):
            flush()
            out.append(("heading", stripped))
        elif stripped.startswith("|"):
            flush()
            out.append(("table", stripped))
        elif stripped.startswith("<!--") and stripped.endswith("-->"):
            flush()
            out.append(("comment", stripped))
        elif _LIST_ITEM.match(line):
            flush()
            item = [_LIST_ITEM.sub("", line, count=1).strip()]
        elif item is not None:
            item.append(stripped)  # a continuation line of the item
        else:
            paragraph.append(stripped)
    flush()
    return out


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _headings(text: str, level: int = None) -> list:
    found = [_HEADING.match(t) for kind, t in blocks(text) if kind == "heading"]
    return [m.group(2) for m in found if level is None or len(m.group(1)) == level]


@pytest.fixture(scope="module")
def page() -> str:
    return _read(PAGE)


def _contents(text: str) -> list:
    """Anchors linked from the list items above the first ## heading: the table of contents."""
    head = re.split(r"^## ", text, maxsplit=1, flags=re.M)[0]
    return [target[1:] for kind, item in blocks(head) if kind == "item"
            for target in _LINK.findall(item) if target.startswith("#")]


def test_contents_match_the_sections(page):
    contents = _contents(page)
    assert contents, "no table of contents (a list of #links) before the first ## section"
    assert len(contents) == len(set(contents)), f"repeated contents entries: {contents}"
    sections = anchors(_headings(page, level=2))
    missing = [a for a in sections if a not in contents]
    assert not missing, f"## sections without a contents entry: {missing}"
    assert KERAS_ANCHOR in contents, "the contents lack the keras_step_time entry"
    keras_written = KERAS_BEGIN in page and KERAS_END in page
    dangling = [a for a in contents if a not in sections
                and not (a == KERAS_ANCHOR and not keras_written)]
    assert not dangling, f"contents entries without a ## section: {dangling}"


def test_notes_links_resolve(page):
    notes = [t for t in _LINK.findall(page) if t.startswith("notes/")]
    assert notes, "no section links to its notes under docs/notes/"
    for target in notes:
        path, _, anchor = target.partition("#")
        full = os.path.join(DOCS, path)
        assert os.path.isfile(full), f"{target}: no such file under docs/"
        if anchor:
            assert anchor in anchors(_headings(_read(full))), f"{target}: no such heading"


def test_relative_links_resolve():
    """Every relative link of the page (images included) and of the notes points at a file,
    and at a heading of it when it names one; the page's own #links are the contents above."""
    notes_dir = os.path.join(DOCS, "notes")
    sources = [PAGE] + sorted(os.path.join(notes_dir, name) for name in os.listdir(notes_dir)
                              if name.endswith(".md"))
    for source in sources:
        for target in _LINK.findall(_read(source)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or (source == PAGE
                                                             and target.startswith("#")):
                continue  # another site, or the page's contents
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(os.path.dirname(source), path)) if path \
                else source
            where = f"{os.path.relpath(source, DOCS)}: {target}"
            assert os.path.exists(full), f"{where}: no such file"
            if anchor and full.endswith(".md"):
                text = _read(full)
                unwritten = (anchor == KERAS_ANCHOR and full == PAGE
                             and KERAS_BEGIN not in text)
                assert anchor in anchors(_headings(text)) or unwritten, f"{where}: no such heading"


def test_paragraphs_and_list_items_are_short(page):
    long = [f"{kind} of {len(text)} characters: {text[:80]}..."
            for kind, text in blocks(page)
            if kind in ("paragraph", "item") and len(text) > MAX_CHARS]
    assert not long, "\n".join(long)


def test_block_parser():
    text = ("# T\n\nintro line one\nline two\n\n- [a](#a)\n  more of a\n- b\n\n"
            "| x |\n|---|\n\n```\n" + "code " * 200 + "\n```\n<!-- m -->\n## A\n")
    assert blocks(text) == [
        ("heading", "# T"), ("paragraph", "intro line one line two"),
        ("item", "[a](#a) more of a"), ("item", "b"), ("table", "| x |"), ("table", "|---|"),
        ("comment", "<!-- m -->"), ("heading", "## A")]
    assert github_anchor("Keras fit step time vs tf.distribute (`keras_step_time`)") \
        == KERAS_ANCHOR
    assert github_anchor("Sampling and scoring AutoStrategy's candidates (`sampling_speed`)") \
        == "sampling-and-scoring-autostrategys-candidates-sampling_speed"
    assert anchors(["Columns", "Columns"]) == ["columns", "columns-1"]
