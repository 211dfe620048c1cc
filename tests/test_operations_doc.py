"""docs/OPERATIONS.md: every `burstfs` and `burstfs-admin` command it shows exists with
the options it uses, and its config file examples pass `burstfs config check`."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import click
import pytest
from conftest import BIN

from burstfs.admin import main as admin_main
from burstfs.cli import main as cli_main

DOC = Path(__file__).resolve().parent.parent / "docs" / "OPERATIONS.md"


def commands_in_doc() -> list[list[str]]:
    """Each `burstfs ...`/`burstfs-admin ...` invocation, from code spans and code blocks."""
    text = DOC.read_text()
    pieces = re.findall(r"```sh\n(.*?)```", text, flags=re.S) + re.findall(r"`([^`\n]+)`", text)
    found = []
    for piece in pieces:
        for line in piece.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0]
            # at the start, after ; && | $( , after VAR=value or `time`: not "kubectl -n burstfs ..."
            for match in re.finditer(r"(?:^|[;&|(])\s*(?:\w+=\S+\s+|time\s+)*(burstfs(?:-admin)? [^;&|)]+)", line):
                words = shlex.split(match.group(1))
                if len(words) > 1 and re.fullmatch(r"[a-z]+", words[1]):
                    found.append(words)
    return found


def resolve_command(words: list[str]) -> tuple[click.Command, list[str]]:
    group: click.Command = admin_main if words[0] == "burstfs-admin" else cli_main
    rest = words[1:]
    while isinstance(group, click.Group):
        assert rest and rest[0] in group.commands, f"{' '.join(words)}: no command {rest[:1]} in {words[0]}"
        group, rest = group.commands[rest[0]], rest[1:]
    return group, rest


def test_every_command_in_the_runbook_exists_with_its_options() -> None:
    commands = commands_in_doc()
    assert len(commands) > 20  # the extraction found the runbook's commands
    for words in commands:
        command, rest = resolve_command(words)
        known = {opt for param in command.params for opt in param.opts}
        for word in rest:
            if word.startswith("--"):
                assert word.split("=", 1)[0] in known, f"{' '.join(words)}: {word} is not an option of it"


def test_runbook_config_files_pass_config_check(tmp_path: Path) -> None:
    blocks = re.findall(r"<<'TOML'\n(.*?)\nTOML", DOC.read_text(), flags=re.S)
    assert blocks
    for i, block in enumerate(blocks):
        config = tmp_path / f"example{i}.toml"
        config.write_text(block + "\n")
        result = subprocess.run(
            [str(BIN / "burstfs"), "config", "check", str(config)], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("words", [["burstfs", "mount", "--nope"], ["burstfs-admin", "stat", "x"]])
def test_the_check_catches_a_wrong_command(words: list[str]) -> None:
    with pytest.raises(AssertionError):
        command, rest = resolve_command(words)
        known = {opt for param in command.params for opt in param.opts}
        assert all(w in known for w in rest if w.startswith("--"))
