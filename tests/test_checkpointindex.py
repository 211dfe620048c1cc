"""What a checkpoint's index names (burstfs.checkpointindex): read, never unpickled."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from burstfs.checkpointindex import dcp_metadata_files, index_kind, named_files, read_index


def test_a_dcp_metadata_names_its_data_files_without_being_unpickled(tmp_path: Path) -> None:
    """The names torch's own writer gives, in a real ``.metadata``; and a pickle that would run
    code when loaded is only scanned."""
    torch = pytest.importorskip("torch")
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    state = {f"w{i}": torch.full((1000,), float(i)) for i in range(6)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path), thread_count=3))
    on_disk = sorted(p.name.encode() for p in tmp_path.glob("*.distcp"))
    assert len(on_disk) == 3
    assert sorted(named_files(b".metadata", read_index(tmp_path / ".metadata", b".metadata"))) == on_disk

    class Boom:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (print, ("unpickled!",))

    data = pickle.dumps({"storage_data": {"a": "__7_0.distcp"}, "x": Boom()})
    assert dcp_metadata_files(data) == [b"__7_0.distcp"]


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_only_whole_strings_of_a_dcp_file_name_count(protocol: int) -> None:
    names = ["__1_0.distcp", "x__2_0.distcp", "a" * 300 + "__3_0.distcp", "__1_0.distcp", "__10_2.distcp"]
    assert dcp_metadata_files(pickle.dumps(names, protocol=protocol)) == [b"__1_0.distcp", b"__10_2.distcp"]


def test_an_index_too_big_names_nothing_and_other_files_are_no_index(tmp_path: Path) -> None:
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "m-1.safetensors", "b": "m-2.safetensors", "c": "../x"}}))
    assert named_files(index.name.encode(), read_index(index, index.name.encode())) == [
        b"m-1.safetensors",
        b"m-2.safetensors",
    ]
    index.write_bytes(b" " * (17 << 20))
    assert read_index(index, index.name.encode()) == b""
    assert index_kind(b"model.safetensors") is None and named_files(b"notes.txt", b"__1_0.distcp") == []
