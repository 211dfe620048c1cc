"""The config tree, its round trip through the journal, and `burstfs mount --config FILE.toml`."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any

import click
import pytest
from conftest import FUSE_OK, burstfs, is_mounted

from burstfs import configfile
from burstfs.cli import mount as mount_command
from burstfs.config import (
    DrainOptions,
    MountConfig,
    S3Options,
    TierOptions,
    check_node_id,
    check_read_ahead,
    config_from_meta,
    configured_endpoint,
    endpoint_store,
    parse_remote_url,
    recorded_store,
)
from burstfs.errors import ConfigError
from burstfs.journal import Journal

DOC = Path(__file__).parent.parent / "docs" / "CONFIGURATION.md"

#: A valid value for each option whose default is unset (the test needs one to set).
SAMPLES: dict[str, Any] = {
    "mountpoint": "/mnt/ckpt",
    "cache": "/local/burstfs",
    "remote": "s3://bucket/run",
    "endpoint-url": "http://127.0.0.1:9000",
    "region": "eu-west-1",
    "cache-size": "20G",
    "metrics-addr": "127.0.0.1:9100",
    "node-id": "n17",
}


#: The keys every mount needs, so that an error about a value is the file's first.
REQUIRED = 'mountpoint = "/m"\ncache = "/c"\nremote = "file:///r"\n'


def file_options() -> list[click.Parameter]:
    return list(configfile.file_params(mount_command).values())


def doc_rows() -> dict[str, str]:
    """{key: default column} of the option tables of docs/CONFIGURATION.md."""
    rows = {}
    for line in DOC.read_text().splitlines():
        match = re.match(r"^\| `([a-z-]+)` \| (.*?) \|", line)
        if match:
            rows[match.group(1)] = match.group(2)
    return rows


def write(tmp_path: Path, text: str, name: str = "burstfs.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_every_mount_option_is_documented_with_its_default() -> None:
    rows = doc_rows()
    defaults = configfile.defaults(mount_command)
    for param in file_options():
        key = configfile.file_key(param)
        assert key in rows, f"docs/CONFIGURATION.md has no row for {key}"
        default = defaults[param.name]
        if default is None:
            assert rows[key] in ("(required)", "(not set)"), f"{key}: documented default {rows[key]}"
        else:
            assert rows[key] == f"`{configfile._toml(default)}`", f"{key}: code default {default!r}, doc {rows[key]}"
    assert set(rows) == {configfile.file_key(p) for p in file_options()}, "the doc lists an option the command lacks"


@pytest.mark.parametrize("spelling", ["-", "_"])
def test_the_config_file_accepts_every_mount_option(tmp_path: Path, spelling: str) -> None:
    ctx = click.Context(mount_command)
    defaults = configfile.defaults(mount_command)
    for param in file_options():
        key = configfile.file_key(param)
        value = SAMPLES.get(key, defaults[param.name])
        if isinstance(value, tuple):
            value = list(value)
        toml_key = key.replace("-", spelling)
        loaded = configfile.load(write(tmp_path, f"{toml_key} = {configfile._toml(value)}\n"), mount_command)
        assert param.name in loaded.values, key
        expected = param.type_cast_value(ctx, value)
        if isinstance(param.type, click.Path):
            expected = tmp_path / expected
        assert loaded.values[param.name] == expected, key


def test_a_minimal_file_and_the_command_line_build_the_same_tree(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        'mountpoint = "mnt"\ncache = "/var/cache/b"\nremote = "file:///srv/ckpt"\ncache_size = "2G"\n'
        'commit-marker = "done"\ncompress = "lz4"\n',
    )
    loaded = configfile.load(path, mount_command)
    values = configfile.merge(configfile.defaults(mount_command), loaded, set())
    config = configfile.build_with_file(values, loaded, mount_command)
    assert config == MountConfig(
        mountpoint=tmp_path / "mnt",
        cache_dir=Path("/var/cache/b"),
        remote=parse_remote_url("file:///srv/ckpt"),
        drain=DrainOptions(commit_markers=("done",), compress="lz4"),
        tier=TierOptions(cache_size=2 << 30),
    )
    overridden = configfile.merge({**values, "compress": "none"}, loaded, {"compress"})  # --compress none given
    assert configfile.build_with_file(overridden, loaded, mount_command).drain.compress is None


def test_relative_paths_of_a_file_are_normalized_against_its_directory(tmp_path: Path) -> None:
    """``cache = "../cache"`` in ``conf/burstfs.toml``: status and the log showed
    ``.../conf/../cache``; the path is the directory's, normalized."""
    (tmp_path / "conf").mkdir()
    path = write(tmp_path / "conf", 'mountpoint = "../mnt"\ncache = "../cache/./b"\nremote = "file:///srv/ckpt"\n')
    loaded = configfile.load(path, mount_command)
    values = configfile.merge(configfile.defaults(mount_command), loaded, set())
    config = configfile.build_with_file(values, loaded, mount_command)
    assert config.cache_dir == tmp_path / "cache" / "b" and str(config.cache_dir) == str(tmp_path / "cache/b")
    assert config.mountpoint == tmp_path / "mnt"
    shown = burstfs("config", "check", str(path)).stdout  # what a mount with it would use, as it would
    assert f'mountpoint = "{tmp_path / "mnt"}"' in shown and f'cache = "{tmp_path / "cache/b"}"' in shown, shown


@pytest.mark.parametrize(
    "text, line, key, message",
    [
        ('mountpoint = "/m"\n\ncache_sise = "2G"\n', 3, "cache_sise", "unknown key"),
        ('# a comment\nconcurrency = "many"\n', 2, "concurrency", 'expected a whole number, not "many"'),
        (
            'mountpoint = "/m"\npart-size = "1M"\ncache = "/c"\nremote = "file:///r"\n',
            2,
            "part-size",
            "part size must be between",
        ),
        (
            'cache = "/c"\nremote = "file:///r"\nmountpoint = "/m"\n  evict = "random"\n',
            4,
            "evict",
            "'random' is not one of",
        ),
        ('cache = "/c"\nremote = "s3://Bad_Bucket"\nmountpoint = "/m"\n', 2, "remote", "not a valid S3 bucket name"),
        ("full-timeout = 1.0\nfull_timeout = 2.0\n", 2, "full_timeout", "set twice"),
        ('mountpoint = "/m"\n[s3]\nregion = "x"\n', 2, "s3", "unknown key"),
        (
            'cache = "/c"\nremote = "file:///r"\nmountpoint = "/m"\n"cache-size" = "lots"\n',
            4,
            "cache-size",
            "not a size",
        ),
        ('min-free = ["1G"]\n', 1, "min-free", "a list"),
        ('mountpoint = "m"\ncache = 5\nremote = "file:///r"\n', 2, "cache", "expected a string, not 5"),
        ('cache = "/c"\nmountpoint = 5\n', 2, "mountpoint", "expected a string, not 5"),
        ("concurrency = 8.7\n", 1, "concurrency", "expected a whole number, not 8.7"),
        ("max-files = true\n", 1, "max-files", "expected a whole number, not true"),
        ("commit-marker = [1, 2]\n", 1, "commit-marker", "expected a string (or a list of them), not 1"),
        ("commit-marker = 5\n", 1, "commit-marker", "expected a string (or a list of them), not 5"),
        ('foreground = "yes"\n', 1, "foreground", 'expected true or false, not "yes"'),
        ('list-ttl = "5"\n', 1, "list-ttl", 'expected a number, not "5"'),
        ("part-size = 8.5\n", 1, "part-size", "expected a size"),
        ("endpoint-url = 5\n", 1, "endpoint-url", "expected a string, not 5"),
        ("metrics-addr = 5\n", 1, "metrics-addr", "expected a string, not 5"),
        (REQUIRED + "full-timeout = nan\n", 4, "full-timeout", "must be a number of seconds"),
        (REQUIRED + "drain-delay = inf\n", 4, "drain-delay", "must be a number of seconds"),
        (REQUIRED + "remote-wait = -inf\n", 4, "remote-wait", "from 0 to 60"),
        (REQUIRED + 'metrics-addr = "127.0.0.1:99999"\n', 4, "metrics-addr", "the port must be a number from 1 to"),
        (
            'mountpoint = "/m"\ncache = "/c"\nremote = "s3://bucket/p"\nendpoint-url = "notaurl"\n',
            4,
            "endpoint-url",
            "'notaurl': not an S3 endpoint",
        ),
        (  # botocore refused it at the first request: "cannot talk to ... AUTHORIZATION header"
            REQUIRED + 'endpoint-url = "http://admin:hunter2@127.0.0.1:9000"\n',
            4,
            "endpoint-url",
            "'http://admin:***@127.0.0.1:9000': credentials in the URL are not used for S3",
        ),
        *(  # a password holding / ? or # was taken for the URL's path and printed in clear
            (
                REQUIRED + f'endpoint-url = "http://admin:top{sep}S3cr3t@127.0.0.1:9000"\n',
                4,
                "endpoint-url",
                "'http://admin:***@127.0.0.1:9000': not an S3 endpoint",
            )
            for sep in "/?#"
        ),
        (  # it listed and rewrote the manifests of the mount on s3://bkt/run
            'mountpoint = "/m"\ncache = "/c"\nremote = "s3://bkt/run/.burstfs"\n',
            3,
            "remote",
            "'.burstfs' is where burstfs keeps the bookkeeping",
        ),
        (REQUIRED + "read-ahead = 0\n", 4, "read-ahead", "--read-ahead must be a multiple of 4K"),
        (REQUIRED + 'read-ahead = "3"\n', 4, "read-ahead", "not 3 bytes"),
        (REQUIRED + 'node-id = ""\n', 4, "node-id", "--node-id is empty"),
        (REQUIRED + 'region = "bad region!"\n', 4, "region", "--region 'bad region!': not a region name"),
    ],
)
def test_bad_files_name_the_line_and_the_key_and_exit_2(
    tmp_path: Path, text: str, line: int, key: str, message: str
) -> None:
    path = write(tmp_path, text)
    result = burstfs("config", "check", str(path), check=False)
    assert result.returncode == 2, result.stderr
    assert "hunter2" not in result.stdout + result.stderr and "S3cr3t" not in result.stdout + result.stderr
    assert f"{path}:{line}: key '{key}'" in result.stderr and message in result.stderr, result.stderr
    mounted = burstfs("mount", "--config", str(path), check=False)
    assert mounted.returncode == 2 and f"{path}:{line}: key '{key}'" in mounted.stderr, mounted.stderr


@pytest.mark.parametrize(
    "url",
    [
        "s3://bkt/.burstfs",
        "s3://bkt/.burstfs/",
        "s3://bkt/run/.burstfs",
        "s3://bkt/run/.burstfs/x",
        "file:///srv/r/.burstfs",
        "file:///srv/r/.burstfs/manifests",
        "file:///srv/r/%2Eburstfs",  # a file URL's path is unquoted: this is /srv/r/.burstfs
    ],
)
def test_a_remote_inside_the_bookkeeping_of_another_is_refused(url: str) -> None:
    """burstfs keeps a prefix's manifests and records under PREFIX/.burstfs/: a mount whose
    prefix lies in there lists and rewrites those of the mount on the prefix above."""
    with pytest.raises(ConfigError, match="keeps the bookkeeping of the prefix above") as raised:
        parse_remote_url(url)
    assert raised.value.option == "remote" and repr(url) in str(raised.value)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("s3://bkt/run\t42", "control characters"),  # urlparse dropped the tab: the files went to run42/
        ("file:///srv/remote dir\nx", "control characters"),  # and the newline: to /srv/remote dirx
        ("s3://bkt//x", "empty, '.' or '..' components"),  # was taken as s3://bkt/x
        ("s3://bkt/a//b", "empty, '.' or '..' components"),
    ],
)
def test_a_remote_url_that_would_be_rewritten_is_refused(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_remote_url(url)


@pytest.mark.parametrize(
    "url", ["s3://bkt/.burstfs2", "s3://bkt/run.burstfs", "s3://bkt/burstfs/x", "file:///srv/r/.burstfs-old"]
)
def test_names_that_only_look_like_the_bookkeeping_dir_are_remotes(url: str) -> None:
    assert str(parse_remote_url(url)) == url


@pytest.mark.parametrize("nbytes", [0, 3, 1024, 4095, 6 << 10, (1 << 30) + 4096, 1 << 40, -4096])
def test_read_ahead_out_of_range_or_not_whole_pages_is_refused(nbytes: int) -> None:
    """The daemon writes it to the bdi's read_ahead_kb (at least 4), which the kernel keeps in
    pages: 0 and 3 bytes became 4 KiB, 6 KiB one page, without a word."""
    with pytest.raises(ConfigError, match=f"from 4K to 1G, not {nbytes} bytes") as raised:
        check_read_ahead(nbytes)
    assert raised.value.option == "read-ahead"
    with pytest.raises(ConfigError):
        MountConfig(
            mountpoint=Path("/m"), cache_dir=Path("/c"), remote=parse_remote_url("file:///r"), read_ahead=nbytes
        )


@pytest.mark.parametrize("nbytes", [4 << 10, 128 << 10, 1 << 20, 3 << 20, 1 << 30])
def test_read_ahead_in_whole_pages_is_taken(nbytes: int) -> None:
    assert check_read_ahead(nbytes) == nbytes


def test_a_journal_with_a_read_ahead_an_older_burstfs_took_still_drains() -> None:
    """`burstfs drain` reads the last mount's config back; its --read-ahead matters only to
    that mount, so a value refused now is no reason to leave the cache undrained."""
    config = MountConfig(mountpoint=Path("/m"), cache_dir=Path("/c"), remote=parse_remote_url("file:///r"))
    doc = json.loads(config.to_json())
    assert MountConfig.from_json(json.dumps({**doc, "read_ahead": 3})) == config


def values_with(**options: Any) -> dict[str, Any]:
    """The mount command's values, as the command line delivers them, with ``options`` set."""
    base = {"mountpoint": "/m", "cache_dir": "/c", "remote": "file:///r"}
    return {**configfile.defaults(mount_command), **base, **options}


def test_an_empty_node_id_is_refused_and_a_missing_one_is_the_host_name() -> None:
    """--node-id "" mounted as the host name, as if it had not been given."""
    with pytest.raises(ConfigError, match="--node-id is empty") as raised:
        configfile.build_config(values_with(node_id=""))
    assert raised.value.option == "node-id"
    assert configfile.build_config(values_with(node_id=None)).drain.node_id == ""
    assert configfile.build_config(values_with(node_id="n-1.a_b")).drain.node_id == "n-1.a_b"


@pytest.mark.parametrize("node_id", ["n1\n", "a@b", "a/b", "a b", "\tn1", ".n1", "-n1", "n" * 64, "nöde"])
def test_node_ids_that_do_not_fit_a_record_key_are_refused(node_id: str) -> None:
    """'@' parts the round id in a record key, '/' is a directory, whitespace (a trailing
    newline too, which a plain ``$`` let through) ends a line of the logs and listings."""
    with pytest.raises(ConfigError, match="use 1-63 letters, digits"):
        check_node_id(node_id)
    with pytest.raises(ConfigError):
        configfile.build_config(values_with(node_id=node_id))


@pytest.mark.parametrize(
    "region", ["bad region!", "", "us_east_1", "-us-east-1", "us-east-1-", "123", "r" * 64, "us-east-1\n", "eu.west"]
)
def test_a_region_that_is_no_region_name_is_refused_at_parsing(region: str) -> None:
    """botocore refuses it only at the first request: the mount exited 1, "cannot talk to"."""
    with pytest.raises(ConfigError, match="not a region name") as raised:
        S3Options(region=region)
    assert raised.value.option == "region"
    with pytest.raises(ConfigError, match="not a region name"):
        configfile.build_config(values_with(region=region, remote="s3://bkt/p"))


@pytest.mark.parametrize("region", ["us-east-1", "us-gov-west-1", "cn-north-1", "r", "default", "EU", "zg1"])
def test_region_names_of_aws_and_other_stores_are_taken(region: str) -> None:
    assert S3Options(region=region).region == region


def test_sizes_take_whole_numbers_and_durations_integers(tmp_path: Path) -> None:
    """The documented alternatives to the command line's spelling are no wrong types."""
    path = write(tmp_path, REQUIRED + "cache-size = 1073741824\nlist-ttl = 5\nfull-timeout = 0\n")
    loaded = configfile.load(path, mount_command)
    values = configfile.merge(configfile.defaults(mount_command), loaded, set())
    config = configfile.build_with_file(values, loaded, mount_command)
    assert config.tier.cache_size == 1 << 30 and config.list_ttl == 5.0 and config.tier.full_timeout == 0.0


def test_not_toml_and_missing_required_options_exit_2(tmp_path: Path) -> None:
    result = burstfs("config", "check", str(write(tmp_path, "cache = \n")), check=False)
    assert result.returncode == 2 and "not valid TOML" in result.stderr and "line 1" in result.stderr
    result = burstfs("config", "check", str(write(tmp_path, 'cache = "/c"\nmountpoint = "/m"\n')), check=False)
    assert result.returncode == 2 and "Missing option '--remote'" in result.stderr


def test_config_check_prints_the_effective_settings_without_secrets(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        'mountpoint = "/m"\ncache = "/c"\nremote = "s3://bucket/p"\n'
        'endpoint_url = "http://127.0.0.1:9000"\nconcurrency = 16\n',
    )
    result = burstfs("config", "check", str(path))
    assert 'endpoint-url = "http://127.0.0.1:9000"' in result.stdout
    assert "concurrency = 16" in result.stdout and 'part-size = "8M"' in result.stdout  # set, and defaulted
    assert "# cache-size (not set)" in result.stdout
    keys = {line.split()[0] if not line.startswith("#") else line.split()[1] for line in result.stdout.splitlines()[1:]}
    assert keys == {configfile.file_key(p) for p in file_options()}


def test_config_check_notes_a_file_remote_that_is_not_there(tmp_path: Path) -> None:
    """It called the file valid, and the mount with it then failed: the directory may be a
    parallel file system mounted later, so a note on stderr, and still exit 0."""
    text = f'mountpoint = "/m"\ncache = "/c"\nremote = "file://{tmp_path}/remote"\n'
    result = burstfs("config", "check", str(write(tmp_path, text)))
    assert f"remote directory {tmp_path}/remote does not exist" in result.stderr and "valid" in result.stdout
    (tmp_path / "remote").mkdir()
    assert "note" not in burstfs("config", "check", str(write(tmp_path, text))).stderr


def test_the_config_round_trips_through_the_journal(tmp_path: Path) -> None:
    config = MountConfig(
        mountpoint=Path("/mnt/x"),
        cache_dir=tmp_path,
        remote=parse_remote_url("s3://bucket/run"),
        s3=S3Options(endpoint_url="http://127.0.0.1:9000", region="r"),
        drain=DrainOptions(part_size=16 << 20, compress="lz4", commit_markers=("a", "*.b"), delay=2.5),
        tier=TierOptions(cache_size=1 << 30, min_free=5, evict="fifo", full_timeout=3.0),
        fsync_remote=True,
        list_ttl=4.0,
        remote_wait=0.5,
        metrics_addr="127.0.0.1:1",
    )
    assert MountConfig.from_json(config.to_json()) == config
    journal = Journal(tmp_path)
    try:
        journal.set_meta("config", config.to_json())
        moved = tmp_path / "moved"
        assert config_from_meta(journal.get_meta, moved) == dataclasses.replace(config, cache_dir=moved)
    finally:
        journal.close()


def test_a_cache_mounted_before_the_config_was_journaled_still_drains(tmp_path: Path) -> None:
    """Caches journaled remote, s3 and drain apart; burstfs drain and burstfs-admin read those."""
    meta = {"remote": "file:///srv/r", "s3": '{"region": "r"}', "drain": '{"delay": 2.0, "commit_markers": ["m"]}'}
    config = config_from_meta(meta.get, tmp_path)
    assert config is not None and config.remote == parse_remote_url("file:///srv/r") and config.s3.region == "r"
    assert config.drain == DrainOptions(delay=2.0, commit_markers=("m",))
    assert config_from_meta({}.get, tmp_path) is None


#: An AWS config file that sets S3 endpoints botocore honours: a services section for the default
#: profile, a plain endpoint_url for another.
AWS_CONFIG = """\
[default]
services = stores

[services stores]
s3 =
  endpoint_url = http://Service.example:9000

[profile plain]
endpoint_url = https://profile.example
"""


@pytest.mark.parametrize(
    ("env", "store", "source"),
    [
        (
            {"AWS_ENDPOINT_URL_S3": "http://s3-env.example:1", "AWS_ENDPOINT_URL": "http://env.example:2"},
            "http://s3-env.example:1",
            "AWS_ENDPOINT_URL_S3",
        ),
        ({"AWS_ENDPOINT_URL": "http://env.example:2"}, "http://env.example:2", "AWS_ENDPOINT_URL"),
        ({}, "http://service.example:9000", "profile default"),
        ({"AWS_PROFILE": "plain"}, "https://profile.example:443", "profile plain"),
        ({"AWS_ENDPOINT_URL": "http://env.example:2", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS": "true"}, "aws", None),
    ],
)
def test_the_store_is_the_endpoint_botocore_takes_from_the_environment_or_config_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, env: dict[str, str], store: str, source: str | None
) -> None:
    """The store a cache records was only --endpoint-url or $AWS_ENDPOINT_URL: an endpoint set
    through $AWS_ENDPOINT_URL_S3 or the AWS config file was recorded as "aws", and switching it
    went unseen by the store check.  The store is the endpoint a botocore client would use."""
    import botocore.session
    from botocore import UNSIGNED
    from botocore.config import Config

    for name in [name for name in os.environ if name.startswith("AWS_")]:
        monkeypatch.delenv(name)
    (tmp_path / "aws-config").write_text(AWS_CONFIG)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config"))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert S3Options().store() == store
    unsigned = Config(signature_version=UNSIGNED)  # no credential lookup: nothing leaves the machine
    used = botocore.session.Session().create_client("s3", region_name="us-east-1", config=unsigned).meta.endpoint_url
    assert endpoint_store(None if used.endswith(".amazonaws.com") else used) == store
    found = configured_endpoint()
    if source is None:
        assert found is None
    else:
        assert found is not None and source in found[1]
    assert S3Options(endpoint_url="http://given.example").store() == "http://given.example:80"  # the option wins


def test_a_cache_from_before_the_store_was_recorded_has_the_store_of_its_journaled_endpoint() -> None:
    """A cache last mounted by a burstfs that did not record its store took on the store of its
    next mount, whichever; the --endpoint-url its last mount journaled says where its files went."""
    config = MountConfig(
        mountpoint=Path("/m"),
        cache_dir=Path("/c"),
        remote=parse_remote_url("s3://bucket/run"),
        s3=S3Options(endpoint_url="http://Old.example:9000"),
        drain=DrainOptions(),
    )
    assert recorded_store({"config": config.to_json()}.get) == "http://old.example:9000"
    legacy = {"remote": "s3://bucket/run", "s3": '{"endpoint_url": "https://old.example"}'}  # before the config
    assert recorded_store(legacy.get) == "https://old.example:443"
    assert recorded_store({"store": "aws", "config": config.to_json()}.get) == "aws"
    # AWS's own or an endpoint from the environment: never journaled, so unknown.
    assert recorded_store({"config": dataclasses.replace(config, s3=S3Options()).to_json()}.get) is None
    assert recorded_store({}.get) is None


@pytest.mark.skipif(not FUSE_OK, reason="needs /dev/fuse, fusermount3 and root")
def test_mount_with_a_config_file_and_a_command_line_override(tmp_path: Path) -> None:
    (tmp_path / "mnt").mkdir()
    (tmp_path / "remote").mkdir()
    path = write(
        tmp_path,
        f'mountpoint = "mnt"\ncache = "cache"\nremote = "file://{tmp_path}/remote"\n'
        "list-ttl = 5.0\ndrain-delay = 0.0\n",
    )
    burstfs("mount", "--config", str(path), "--list-ttl", "7")
    try:
        assert is_mounted(tmp_path / "mnt")
        (tmp_path / "mnt" / "f").write_bytes(b"x")
        journal = Journal(tmp_path / "cache", readonly=True)
        try:
            config = config_from_meta(journal.get_meta, tmp_path / "cache")
        finally:
            journal.close()
        assert config is not None and config.list_ttl == 7.0 and config.mountpoint == tmp_path / "mnt"
    finally:
        burstfs("unmount", "--wait", "--wait-timeout", "60", str(tmp_path / "mnt"))
    assert (tmp_path / "remote" / "f").read_bytes() == b"x"
