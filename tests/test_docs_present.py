"""The pages describe megarl as it is; dated figures live in one record, docs/measurements.md.

    python -m pytest -q tests/test_docs_present.py

Checked: every page under docs/ except the record, README.md, and the comments and docstrings of
megarl/, benchmarks/ and tests/ (string literals that are data or messages are not prose). A marker
of history or of a measurement's conditions is refused there:
- a tracker number of megarl's own: the word issue followed by a bare number. A citation of another
  project keeps its '#' and names the project ("vLLM's issue #1234", "RFC issue #17778"): allowed;
- a comparison opened by "before" and a colon, or a "round" followed by a number (a review);
- a load average with a figure: the conditions a figure was taken under go to the record with it;
- a date (YYYY-MM-DD): a dated result is a measurement. Allowed where the same line links its
  section of the record, and for another project's release history ("merged YYYY-MM-DD").
A page that needs a figure links docs/measurements.md.
"""
from __future__ import annotations

import ast
import io
import os
import re
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD = "docs/measurements.md"
DATE = re.compile(r"(?<!merged )\b20\d\d-[01]\d-[0-3]\d\b")
MARKERS = [
    (re.compile(r"\bissues? \d", re.I), "a tracker number of megarl's own: say what the code does, or cite "
                                        "another project's issue with its '#'"),
    (re.compile(r"\bbefore:", re.I), "a 'before:' history: describe what megarl does now"),
    (re.compile(r"\bround \d", re.I), "a review round: describe what megarl does now"),
    (re.compile(r"\bload average [~(]?\d", re.I), f"a load average: the figure and its conditions go to {RECORD}"),
    (DATE, f"a dated result: it goes to {RECORD}, the page links it"),
]


def pages() -> list[str]:
    docs = sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
    return [p for p in docs if p != RECORD] + ["README.md"]


def python_files() -> list[str]:
    out = []
    for top in ("megarl", "benchmarks", "tests"):
        for d, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [x for x in dirs if x not in ("assets", "__pycache__")]
            out += [os.path.relpath(os.path.join(d, f), ROOT) for f in files if f.endswith(".py")]
    return sorted(out)


def prose(path: str) -> list[tuple[int, str]]:
    """(line, text) of a Python file's comments and docstrings."""
    src = open(os.path.join(ROOT, path)).read()
    found = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(src).readline)
             if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                found += [(first.lineno + i, line) for i, line in enumerate(first.value.value.splitlines())]
    return found


def offences(where: str, lines: list[tuple[int, str]]) -> list[str]:
    """A line that links a section of the record may carry that section's date."""
    return [f"{where}:{n}: {why}: {text.strip()[:100]!r}" for n, text in lines
            for rx, why in MARKERS if rx.search(text) and not (rx is DATE and "measurements.md#" in text)]


def test_markers_are_found_and_citations_pass():
    """The rule on lines it must refuse and lines it must let through."""
    refused = ["a newcomer's first hour (issue 18)", "Issue 18's first command", "(before: ~4 GB on one rank)",
               "the review of round 2", "load average ~20", "(load average 14-22)", "Measured 2026-11-26, CPU"]
    allowed = ["PR #18397 and RFC issue #17778", "PR #17172, merged 2026-08-04", "the sampler's round-robin",
               "[record](measurements.md#2026-11-24-to-2026-11-27-the-fault-suite)",
               "one H100, 2026-11-26/27 ([record](measurements.md#2026-11-26-one-nvidia-h100-first-run))",
               "the launcher prints the load average beside its figures", "checked before the ranks start"]
    assert all(offences("x", [(1, line)]) for line in refused), [t for t in refused if not offences("x", [(1, t)])]
    assert not offences("x", [(n, line) for n, line in enumerate(allowed)])


def test_pages_describe_the_present():
    found = []
    for page in pages():
        text = open(os.path.join(ROOT, page)).read()
        found += offences(page, list(enumerate(text.splitlines(), 1)))
    assert not found, "history or dated figures outside docs/measurements.md:\n" + "\n".join(found)


def test_code_comments_and_docstrings_describe_the_present():
    found = []
    for path in python_files():
        found += offences(path, prose(path))
    assert not found, "history or dated figures in comments and docstrings:\n" + "\n".join(found)


def test_the_record_is_dated_and_linked():
    """Each section of the record opens with its date; the pages that carried figures link it."""
    text = open(os.path.join(ROOT, RECORD)).read()
    heads = re.findall(r"^## (.*)$", text, re.M)
    assert heads and all(re.match(r"20\d\d-[01]\d-[0-3]\d\b", h) for h in heads), \
        [h for h in heads if not re.match(r"20\d\d-", h)]
    for section in re.split(r"^## ", text, flags=re.M)[1:]:
        for field in ("Machine:", "Command:"):
            assert field in section, f"{RECORD}: section {section.splitlines()[0]!r} lacks {field!r}"
    for page in ("benchmarks.md", "performance.md", "rollout.md", "reliability.md"):
        assert "measurements.md" in open(os.path.join(ROOT, "docs", page)).read(), f"docs/{page} does not link it"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")


def test_links_into_the_record_name_its_sections():
    anchors = {slug(h) for h in re.findall(r"^#+ (.*)$", open(os.path.join(ROOT, RECORD)).read(), re.M)}
    wrong = []
    for page in pages() + [RECORD]:
        text = open(os.path.join(ROOT, page)).read()
        for anchor in re.findall(r"measurements\.md#([\w-]+)", text):
            if anchor not in anchors:
                wrong.append(f"{page}: #{anchor}")
        if page == RECORD:
            wrong += [f"{page}: #{a}" for a in re.findall(r"\]\(#([\w-]+)\)", text) if a not in anchors]
    assert not wrong, f"links to sections {RECORD} does not have: {wrong}"
