"""The docs stay navigable and true: every page linked, every link resolving, every
command block run by a test (or listed with the reason it is not), and the bench
tables on the performance page."""

from __future__ import annotations

import pathlib
import re

import pytest
from switchboard_server import config

from bench import report
from tests.support import doc_blocks
from tests.support.markdown import ROOT, Block, anchors, fenced_blocks, links

README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))


#: Pages another branch creates: links to them may dangle until it is merged.
def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {(README.parent / t.split("#")[0]).resolve() for t in links(README)}
    assert PAGES, "no docs pages"
    assert [p.name for p in PAGES if p.resolve() not in linked] == []


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page: pathlib.Path) -> None:
    broken = []
    for target in links(page):
        if "://" in target or target.startswith("mailto:"):
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
            continue
        if fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target}: no such heading")
    assert broken == []


def _blocks(lang: str) -> list[tuple[str, str]]:
    return [
        (page.relative_to(ROOT).as_posix(), text)
        for page in [README, *PAGES]
        for text in fenced_blocks(page, lang)
    ]


@pytest.mark.parametrize("lang", ["sh", "python"])
def test_every_command_block_is_run_by_a_test_or_listed(lang: str) -> None:
    named = {**doc_blocks.EXECUTED, **doc_blocks.NOT_RUN}
    unnamed, twice = [], []
    for page, text in _blocks(lang):
        matches = [b for b in named if b.matches(page, lang, text)]
        if not matches:
            unnamed.append(f"{page}: {text.splitlines()[0]}")
        elif len(matches) > 1:
            twice.append(f"{page}: {text.splitlines()[0]}")
    assert unnamed == [], "name each in tests/support/doc_blocks.py: EXECUTED or NOT_RUN"
    assert twice == []


def test_each_named_block_exists_and_its_test_reads_it() -> None:
    names = {block: name for name, block in vars(doc_blocks).items() if isinstance(block, Block)}
    for block, test_file in doc_blocks.EXECUTED.items():
        assert block.text()  # exactly one block of its page holds its marker
        assert block in names, f"give {block} a name in doc_blocks"
        source = (ROOT / test_file).read_text()
        assert "tests.support.doc_blocks" in source and f"{names[block]}.text()" in source, (
            f"{test_file} does not run {names[block]}"
        )
    for block, reason in doc_blocks.NOT_RUN.items():
        assert block.text() and reason


def test_bench_tables_live_on_the_performance_page(tmp_path: pathlib.Path) -> None:
    assert report.PAGE == ROOT / "docs" / "performance.md"
    text = report.PAGE.read_text()
    for kind in ("", "idle"):
        begin, end = report.page_markers(kind)
        assert text.count(begin) == 1 and text.count(end) == 1
        assert text.index(begin) < text.index(end)
        assert begin not in README.read_text()
    # The harness's rewrite replaces just the table between a bench's markers.
    copy = tmp_path / "performance.md"
    copy.write_text(text)
    assert report.update_page("| new | table |\n", "idle", page=copy)
    begin, end = report.page_markers("idle")
    rewritten = copy.read_text()
    assert f"{begin}\n| new | table |\n{end}" in rewritten
    assert rewritten.split(begin)[0] == text.split(begin)[0]
    assert rewritten.split(end)[1] == text.split(end)[1]


def test_every_setting_read_from_the_environment_is_in_the_operations_table() -> None:
    read = set(re.findall(r'"(SWITCHBOARD_[A-Z_]+)"', pathlib.Path(config.__file__).read_text()))
    table = (ROOT / "docs" / "operations.md").read_text()
    rows = set(re.findall(r"^\| `(SWITCHBOARD_[A-Z_]+)`", table, flags=re.MULTILINE))
    assert read - rows == set()


def test_the_readme_gives_the_boards_address_before_its_quickstart() -> None:
    """Issue 28 item 13: a newcomer who ran ``scripts/serve`` learns where the board is
    (the default HTTP listener's ``/board``; ``/`` redirects there, tests/grpc/test_board.py)."""
    text = (ROOT / "README.md").read_text()
    quickstart = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    address = f"http://{config.Settings().http_listen}/board"
    assert f"<{address}>" in quickstart
    assert "`/` redirects there" in quickstart
