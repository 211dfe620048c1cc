"""Smoke test of tools/drill.py: one small round of every drill, through real mounts.

Keeps the reliability drill tool working; the figures themselves (≥ 1,000 faults) come
from a long run by hand (bench/RESULTS.md, "Reliability").  No timing assertions.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import needs_fuse

REPO = Path(__file__).resolve().parent.parent


@needs_fuse
def test_drill_smoke(tmp_path: Path) -> None:
    out = tmp_path / "drill.json"
    cmd = [
        sys.executable,
        str(REPO / "tools" / "drill.py"),
        "--drills",
        "kill,outage,faults,full,corrupt",
        "--rounds",
        "1",
        "--remote",
        "s3",
        "--seed",
        "7",
        "--out",
        str(out),
        "--tmp",
        str(tmp_path),
        "--ranks",
        "2",
        "--kills",
        "1",
        "--kill-window",
        "0.5",
        "--outages",
        "1",
        "--outage-s",
        "1",
        "--faults-s",
        "2",
        "--full-s",
        "2",
        "--corrupt-files",
        "2",
        "--shard",
        "256K",
        "--small-shard",
        "64K",
        "--durable-timeout",
        "120",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    doc = json.loads(out.read_text())
    rows = {row["drill"]: row for row in doc["drills"]}
    assert set(rows) == {"kill", "outage", "faults", "full", "corrupt"}
    for row in rows.values():
        assert row["rounds"] == 1 and not row["skipped"], row
        assert row["files_lost"] == 0 and row["wrong_bytes_served"] == 0, row
        assert not row["problems"], row
    assert rows["kill"]["fault_kinds"] == {"kill -9": 1}
    assert rows["corrupt"]["faults"] == 2
    assert doc["total"]["faults"] >= 4 and doc["total"]["files_closed"] > 0
