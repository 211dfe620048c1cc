"""Run every ```python example of docs/SEMANTICS.md against a fresh mount.

The doc promises behaviour; this keeps the promises true.  Each block is
self-contained, sees ``mnt`` (a pathlib.Path of the mount point), and fails by
raising (its ``assert``s).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "SEMANTICS.md"
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.DOTALL | re.MULTILINE)


def doc_examples() -> list[tuple[str, str]]:
    """(id, source) of each python block, the id naming the section and line."""
    text = DOC.read_text()
    examples = []
    for match in BLOCK.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        heading = re.findall(r"^#+ (.+)$", text[: match.start()], re.MULTILINE)[-1]
        slug = re.sub(r"[^a-z0-9]+", "-", heading.lower()).strip("-")
        examples.append((f"{slug}-line{line}", match.group(1)))
    return examples


EXAMPLES = doc_examples()


def test_the_doc_has_examples() -> None:
    assert len(EXAMPLES) >= 10
    assert all("assert" in source for _, source in EXAMPLES)


@pytest.mark.fuse
@pytest.mark.parametrize("source", [s for _, s in EXAMPLES], ids=[i for i, _ in EXAMPLES])
def test_doc_example(source: str, burst_mount: Path) -> None:
    code = compile(source, f"{DOC.name} example", "exec")
    exec(code, {"mnt": burst_mount, "__name__": "semantics_example"})  # noqa: S102 (the doc is ours)
