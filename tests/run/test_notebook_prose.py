"""The notebooks' prose cannot drift from their output: no hand-typed number in a markdown cell.

Every number a notebook states is rendered from the values it computed (a Markdown display in
a code cell), so it changes when the parameters change. A markdown cell may still name the
allocator's constants (512 B, 1 MiB, 2 MiB, 10 MiB, 20 MiB and the 1-10 MiB class between them),
ordinals of the notebook's own parts (Figure 2, Hazard 1, notebook 05, a numbered list) and
references (links, pull requests, code in backticks, names such as H200 or float32).
"""

import re
from pathlib import Path

import nbformat
import pytest

from graphborrow.studies.course import lesson

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))

CONSTANTS = r"(?:512 B|1 MiB|2 MiB|10 MiB|20 MiB|1[–-]10 MiB)"
TIME_LINE = re.compile(r"^\*\*Time\*\*: about (\d+) minutes( \((\d+ minutes|homework) in the two-hour class\))?\.?$", re.M)
_SCRUB = [
    re.compile(r"```.*?```", re.S),                       # code blocks
    re.compile(r"`[^`]*`"),                               # inline code
    re.compile(r"!?\[[^\]]*\]\([^)]*\)"),                 # links and images, text and target
    re.compile(r"https?://\S+"),                          # bare addresses
    re.compile(r"<[^>]+>"),                               # HTML tags
    TIME_LINE,                                            # checked against the course below
    re.compile(r"^#+ \d\d ·", re.M),                      # the notebook's number in its title
    re.compile(r"^\s*\d+\. ", re.M),                      # numbered lists
    re.compile(r"#\d+"),                                  # pull requests
    re.compile(r"\b(?:arXiv|Figure|Figures|Scenario|Hazard|notebook|notebooks|Exercise|exercise)s? \d+(?:[.,]\d+)*(?:(?:,| and| or|–|-) ?\d+)*"),
    re.compile(rf"\b{CONSTANTS}"),
    re.compile(r"\b[\w.-]*[A-Za-z][\w.-]*\d[\w.-]*|\b\d[\w.-]*[A-Za-z][\w-]*"),  # names: H200, float32, Llama-3-8B
]


def hand_typed_numbers(text: str) -> list[str]:
    """The numbers left in a markdown cell once references, names and the allowed constants are gone."""
    for pattern in _SCRUB:
        text = pattern.sub(" ", text)
    return re.findall(r"\d[\d.,]*", text)


def test_the_scrubber_finds_numbers_and_spares_references():
    assert hand_typed_numbers("the pool holds 1604 MiB") == ["1604"]
    assert hand_typed_numbers("a 12 MiB run and a 4 MiB tensor") == ["12", "4"]
    assert hand_typed_numbers("exactly such runs (20 MiB and 2.0 MiB)") == ["2.0"]
    assert hand_typed_numbers("0.42–0.58× one softmax pass") == ["0.42", "0.58"]
    spared = ("a 1–10 MiB tensor needs a 20 MiB segment of 512 B blocks; see Figure 2 and notebook 05, "
              "[arXiv 2211.17192](https://arxiv.org/abs/2211.17192), pull request #35375, `BATCH_SIZE = 16`, "
              "on an H200 in float32 with Llama-3-8B and EAGLE-3\n1. first\n"
              "**Time**: about 20 minutes (15 minutes in the two-hour class).")
    assert hand_typed_numbers(spared) == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_hand_typed_number_in_a_markdown_cell(path):
    nb = nbformat.read(path, as_version=4)
    found = {i: hand_typed_numbers(c.source) for i, c in enumerate(nb.cells) if c.cell_type == "markdown"}
    found = {i: n for i, n in found.items() if n}
    assert not found, (f"{path.name}: markdown cells {found} state numbers by hand; render them from the computed "
                       "values (prose(f'...') in a code cell) or name an allocator constant")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_time_line_is_the_course_plan(path):
    nb = nbformat.read(path, as_version=4)
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    lines = TIME_LINE.findall(text)
    assert len(lines) == 1, f"{path.name}: one '**Time**: about N minutes (M minutes in the two-hour class).' line"
    minutes, _, short = lines[0]
    plan = lesson(path.stem)
    assert int(minutes) == plan.minutes, f"{path.name}: {minutes} minutes, the course plan says {plan.minutes}"
    short = 0 if short in ("", "homework") else int(short.split()[0])
    assert short == plan.short, (
        f"{path.name}: {short or 'no'} minutes in the two-hour class, the course plan says {plan.short or 'none'}")


GLOSSARY = ROOT / "docs" / "glossary.md"


def glossary_terms() -> dict[str, list[str]]:
    """The glossary's entries (``### Term`` headings) as anchor -> the names a notebook may use for it
    ("Best fit and first fit" is used as "best fit" and as "first fit")."""
    terms = {}
    for heading in re.findall(r"^### (.+)$", GLOSSARY.read_text(), re.M):
        anchor = re.sub(r"[^\w\- ]", "", heading.lower()).strip().replace(" ", "-")
        names = [n.strip().strip("`").lower() for n in re.split(r",| and ", heading) if n.strip()]
        terms[anchor] = names
    return terms


def test_the_glossary_has_the_terms_the_issue_found_undefined():
    names = {n for ns in glossary_terms().values() for n in ns}
    for term in ("dflash", "input-logprob chunks", "precarve", "real bytes", "layout-only", "piecewise capture",
                 "repeat_kv", "free run", "borrow pool", "capacity planner"):
        assert term in names, f"the glossary does not define {term!r}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_glossary_term_a_notebook_uses_links_to_it(path):
    nb = nbformat.read(path, as_version=4)
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    # a link elsewhere (another notebook, a paper) names that page, not a term; a glossary link's text is a use
    words = re.sub(r"\[([^\]]*)\]\(\.\./docs/glossary\.md[^)]*\)", r"\1", text)
    words = re.sub(r"!?\[[^\]]*\]\([^)]*\)", " ", words)
    links = set(re.findall(r"\(\.\./docs/glossary\.md#([\w-]+)\)", text))
    terms = glossary_terms()
    assert links <= set(terms), f"{path.name} links to glossary entries that do not exist: {sorted(links - set(terms))}"
    missing = sorted(anchor for anchor, names in terms.items() if anchor not in links and any(
        re.search(rf"(?<![\w`-]){re.escape(n)}s?(?![\w-])", words, re.I) for n in names))
    assert not missing, (f"{path.name} uses glossary terms without linking them once: {missing} "
                         "(link the first use: [term](../docs/glossary.md#anchor))")
