"""The README stays short and points to the user guide; the guide names only commands and options the CLI has."""

import argparse
import re
from pathlib import Path

from ckptd.cli import _parser

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
GUIDE = REPO / "docs" / "GUIDE.md"
README_MAX_LINES = 200


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    """Return the CLI's subcommands by name, as `ckptd --help` lists them."""
    actions = [a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert len(actions) == 1
    return dict(actions[0].choices)


def _command_lines(text: str) -> list[str]:
    """Return each `ckptd COMMAND ...` the text shows: in code spans, and in code blocks (comments cut off)."""
    found = re.findall(r"`(ckptd [a-z][^`]*)`", text)
    in_block = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_block = not in_block
        elif in_block:
            code = re.split(r"\s#", line, maxsplit=1)[0]
            found += re.findall(r"(?:^|[\s/])(ckptd [a-z].*)", code)
    return found


def test_readme_is_short_and_links_the_guide():
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, f"README.md has {len(text.splitlines())} lines"
    assert "](docs/GUIDE.md" in text
    for doc in ("DESIGN", "OPERATIONS", "FORMAT", "INTERNALS", "SCALE"):
        assert f"](docs/{doc}.md" in text, doc
    assert "](CHANGELOG.md)" in text


def _anchors(markdown: str) -> set[str]:
    """Return the anchors GitHub gives the headings of a markdown text."""
    headings = re.findall(r"^#+ (.+)$", markdown, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_links_into_the_guide_name_its_sections():
    guide = GUIDE.read_text()
    anchors = _anchors(guide)
    links = re.findall(r"\]\(docs/GUIDE\.md#([^)]+)\)", README.read_text())
    links += re.findall(r"\]\(#([^)]+)\)", guide)
    assert links
    assert not [a for a in links if a not in anchors], [a for a in links if a not in anchors]


def test_every_command_and_option_the_guide_names_exists():
    commands = _subcommands()
    shown = _command_lines(GUIDE.read_text())
    assert len(shown) >= len(commands), shown  # the guide shows every command at least once
    named = set()
    for invocation in shown:
        name, _, rest = invocation.partition(" ")[2].partition(" ")
        assert name in commands, f"docs/GUIDE.md names `ckptd {name}`, which the CLI lacks ({invocation!r})"
        named.add(name)
        options = set(commands[name]._option_string_actions)
        for option in re.findall(r"(?<![\w-])--[a-z][a-z-]*", rest):
            assert option in options, f"docs/GUIDE.md gives `ckptd {name}` {option}, which it lacks ({invocation!r})"
    assert named == set(commands), f"commands the guide never shows: {set(commands) - named}"
