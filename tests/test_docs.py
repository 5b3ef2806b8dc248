"""Keep the README short and linked to the guide, and the guide true to the CLI and the config keys."""

import argparse
import dataclasses
import re
import tomllib
from pathlib import Path

from ckptd.cli import _parser
from ckptd.config import _SECTION_TYPES, JobRetentionConfig

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


def _toml_keys(markdown: str) -> list[tuple[str, str]]:
    """Return (section, key) of every setting the text's TOML blocks give; a job's table is retention.jobs."""
    keys = []
    for block in re.findall(r"^```toml\n(.*?)^```", markdown, flags=re.MULTILINE | re.DOTALL):
        for section, values in tomllib.loads(block).items():
            for key, value in values.items():
                if section == "retention" and key == "jobs":
                    keys += [("retention.jobs", k) for job in value.values() for k in job]
                else:
                    keys.append((section, key))
    return keys


def test_the_guides_config_keys_are_the_daemons_and_its_reference_names_them_all():
    guide = GUIDE.read_text()
    fields = {s: {f.name for f in dataclasses.fields(c)} for s, c in _SECTION_TYPES.items()}
    fields["retention.jobs"] = {f.name for f in dataclasses.fields(JobRetentionConfig)}
    fields["retention"].discard("jobs")
    given = _toml_keys(guide)
    assert given
    assert not [k for k in given if k[1] not in fields.get(k[0], ())], [
        k for k in given if k[1] not in fields.get(k[0], ())
    ]
    reference = guide[guide.index("## Configuration\n") :]
    listed = set(_toml_keys(reference[: reference.index("\n```\n") + 5]))
    missing = {(s, k) for s, keys in fields.items() for k in keys} - listed
    assert not missing, f"docs/GUIDE.md, Configuration, lacks {sorted(missing)}"
