"""The mover's bookkeeping, in-process (no FUSE, no remote traffic)."""

from __future__ import annotations

from pathlib import Path

import pytest

from burstfs import mover as mover_module
from burstfs.config import DrainOptions, S3Options, parse_remote_url
from burstfs.journal import Journal
from burstfs.mover import Mover


def test_event_log_is_pruned_to_the_most_recent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    journal = Journal(tmp_path)
    journal.apply([journal.log_event(None, "closed", f"n={i}") for i in range(50)])
    monkeypatch.setattr(mover_module, "EVENTS_KEPT", 10)
    mover = Mover(tmp_path, parse_remote_url(f"file://{tmp_path}"), S3Options(), DrainOptions())
    mover._prune_events()
    details = [detail for _, _, _, detail in journal.events()]
    assert details == [f"n={i}" for i in range(40, 50)]
    journal.apply([journal.log_event(None, "closed", "n=50")])
    mover._prune_events()  # not due again yet: nothing more is dropped
    assert len(journal.events()) == 11
