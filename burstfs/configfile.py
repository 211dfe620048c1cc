"""The mount's options, from the command line and a TOML config file, into the config tree.

A config file holds the options of ``burstfs mount`` as top-level keys named
like the long options (``cache-size`` or ``cache_size``), plus ``mountpoint``;
``burstfs mount --config FILE`` reads it and the command line overrides it.
The keys and their types come from the click command itself, so the file
accepts exactly the options the command line does (docs/CONFIGURATION.md).
tomllib reports no line for a key, so :func:`key_lines` finds them: every
error about a key names the file, the line and the key.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from .config import (
    DrainOptions,
    MountConfig,
    S3Options,
    TierOptions,
    check_node_id,
    parse_remote_url,
    parse_size,
    redact_url,
)
from .errors import ConfigError

MOUNTPOINT = "mountpoint"
#: Options that only make sense on a command line.
NOT_IN_FILE = frozenset({"config_file"})
#: Options whose values are never printed (a URL's user:password).
URL_OPTIONS = frozenset({"endpoint_url"})
#: String options that a file may also give as a whole number of bytes.
SIZE_OPTIONS = frozenset({"cache_size", "min_free", "part_size", "read_ahead"})


def file_key(param: click.Parameter) -> str:
    """The key of ``param`` in a config file: its long option without dashes (``cache-size``)."""
    if isinstance(param, click.Argument):
        return param.human_readable_name.lower()
    long = [opt for opt in param.opts if opt.startswith("--")]
    return long[0][2:] if long else str(param.name)


def file_params(command: click.Command) -> dict[str, click.Parameter]:
    """{normalized key: parameter} of the options a config file may set."""
    params = {}
    for param in command.params:
        if param.name in NOT_IN_FILE or param.name is None:
            continue
        params[_normalize(file_key(param))] = param
    return params


def _normalize(key: str) -> str:
    return key.replace("_", "-")


def key_lines(text: str) -> dict[str, int]:
    """{key as written (bare or quoted): line number} of the top-level keys and tables of a TOML text."""
    lines: dict[str, int] = {}
    pattern = re.compile(r"""^\s*(?:\[+\s*)?(?:"([^"]*)"|'([^']*)'|([A-Za-z0-9_-]+))\s*[=.\]]""")
    in_multiline: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        if in_multiline is not None:  # inside a ''' or """ string: no keys here
            if line.count(in_multiline) % 2 == 1:
                in_multiline = None
            continue
        match = pattern.match(line)
        if match:
            key = next(group for group in match.groups() if group is not None)
            lines.setdefault(key, number)
        for quote in ('"""', "'''"):
            if line.count(quote) % 2 == 1:
                in_multiline = quote
                break
    return lines


@dataclass(frozen=True)
class ConfigFile:
    """A config file's settings, checked against the command's options.

    values: {parameter name: value as the command line would deliver it}.
    where: {parameter name: "FILE:LINE: key 'cache-size'"}, for error messages.
    """

    path: Path
    values: dict[str, Any]
    where: dict[str, str]


def load(path: Path, command: click.Command) -> ConfigFile:
    """Read and check ``path``: unknown keys, tables and values of the wrong type are ConfigErrors naming the line."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path}: not UTF-8 text") from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: not valid TOML: {exc}") from None
    lines = key_lines(text)
    params = file_params(command)
    ctx = click.Context(command)
    values: dict[str, Any] = {}
    where: dict[str, str] = {}
    seen: dict[str, str] = {}
    for key, value in doc.items():
        at = f"{path}:{lines.get(key, '?')}: key {key!r}"
        param = params.get(_normalize(key))
        if param is None:
            known = ", ".join(sorted(params))
            raise ConfigError(f"{at}: unknown key (known keys: {known}; - and _ are alike)")
        if _normalize(key) in seen:
            raise ConfigError(f"{at}: set twice (also as {seen[_normalize(key)]!r})")
        seen[_normalize(key)] = key
        if isinstance(value, dict):
            raise ConfigError(f"{at}: a table; every option is a top-level key (e.g. {key.replace('_', '-')} = ...)")
        if param.multiple and not isinstance(value, list):
            value = [value]  # one value for a list option (its type is checked below)
        if isinstance(value, list) and not param.multiple:
            raise ConfigError(f"{at}: a list; this option takes one value")
        for item in value if param.multiple else [value]:
            expected = _expected_type(param, item)
            if expected is not None:
                raise ConfigError(f"{at}: expected {expected}, not {_toml(item)}")
        try:
            converted = param.type_cast_value(ctx, value)
        except click.BadParameter as exc:
            raise ConfigError(f"{at}: {exc.message}") from None
        if isinstance(param.type, click.Path) and converted is not None:
            converted = path.parent / converted  # relative paths are relative to the file
        assert param.name is not None
        values[param.name] = converted
        where[param.name] = at
    return ConfigFile(path, values, where)


def _expected_type(param: click.Parameter, value: Any) -> str | None:
    """What ``param`` takes, when one TOML ``value`` is not of that type (None when it is).

    Checked before click converts it: click would coerce a wrong type
    (8.7 -> 8, [1, 2] -> ["1", "2"], "yes" -> true) or fail with a TypeError.
    """
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(param.type, click.types.BoolParamType):
        ok, expected = isinstance(value, bool), "true or false"
    elif isinstance(param.type, click.types.IntParamType):
        ok, expected = number and isinstance(value, int), "a whole number"
    elif isinstance(param.type, click.types.FloatParamType):
        ok, expected = number, "a number"
    elif param.name in SIZE_OPTIONS:
        ok = isinstance(value, str) or (number and isinstance(value, int))
        expected = 'a size: a string with a unit ("20G") or a whole number of bytes'
    else:
        ok, expected = isinstance(value, str), "a string"
    if param.multiple:
        expected += " (or a list of them)"
    return None if ok else expected


def defaults(command: click.Command) -> dict[str, Any]:
    """{parameter name: default value} of the command's options, as the command line would deliver them."""
    with command.make_context(command.name, [], resilient_parsing=True) as ctx:  # nothing is required here
        return dict(ctx.params)


def merge(options: dict[str, Any], file: ConfigFile | None, given: set[str]) -> dict[str, Any]:
    """``options`` with the file's values, except for those in ``given`` (set on the command line)."""
    if file is None:
        return dict(options)
    return {**options, **{name: value for name, value in file.values.items() if name not in given}}


def build_config(values: dict[str, Any]) -> MountConfig:
    """The config tree from the options, keyed by the mount command's parameter names.

    Raises ConfigError naming the option for a missing or bad value.
    """
    for name, option in (("mountpoint", "MOUNTPOINT"), ("cache_dir", "--cache"), ("remote", "--remote")):
        if values.get(name) is None:
            key = "mountpoint" if name == "mountpoint" else option[2:]
            raise ConfigError(f"Missing option '{option}' (or '{key}' in the --config file)", key)

    def size(name: str, option: str) -> int:
        try:
            return parse_size(str(values[name]))
        except ConfigError as exc:
            raise ConfigError(f"--{option}: {exc}", option) from None

    try:
        remote = parse_remote_url(values["remote"])
    except ConfigError as exc:
        raise ConfigError(str(exc), "remote") from None
    compress = values["compress"]
    s3 = S3Options(endpoint_url=values["endpoint_url"], region=values["region"])
    if remote.scheme == "s3":
        s3.endpoint()  # a bad $AWS_ENDPOINT_URL is refused here, not by botocore at the first request
    return MountConfig(
        mountpoint=Path(os.path.realpath(values["mountpoint"])),  # as /proc/self/mountinfo will show it
        cache_dir=Path(os.path.abspath(values["cache_dir"])),  # normalized: status and the log show it
        remote=remote,
        s3=s3,
        drain=DrainOptions(
            part_size=size("part_size", "part-size"),
            concurrency=values["concurrency"],
            max_files=values["max_files"],
            compress=None if compress == "none" else compress,
            delay=values["drain_delay"],
            commit_markers=tuple(values["commit_markers"]),
            # not given: "", the host name (or the id the cache was first mounted with); given "": refused
            node_id="" if values["node_id"] is None else check_node_id(values["node_id"]),
        ),
        tier=TierOptions(
            cache_size=size("cache_size", "cache-size") if values["cache_size"] else None,
            min_free=size("min_free", "min-free"),
            evict=values["evict_policy"],
            full_timeout=values["full_timeout"],
        ),
        fsync_remote=values["fsync_mode"] == "remote",
        allow_other=values["allow_other"],
        writeback_cache=not values["no_writeback_cache"],
        passthrough=not values["no_passthrough"],
        read_plans=not values["no_read_plans"],
        list_ttl=values["list_ttl"],
        read_ahead=size("read_ahead", "read-ahead"),
        log_level=values["log_level"].upper(),
        metrics_addr=values["metrics_addr"],
        nonempty=values["nonempty"],
        remote_wait=values["remote_wait"],
    )


def build_with_file(values: dict[str, Any], file: ConfigFile | None, command: click.Command) -> MountConfig:
    """build_config, where an error about a value the file set names the file's line."""
    try:
        return build_config(values)
    except ConfigError as exc:
        name = _param_name(command, exc.option)
        if file is not None and name is not None and name in file.where and _from_file(values, file, name):
            raise ConfigError(f"{file.where[name]}: {exc}", exc.option) from None
        raise


def _from_file(values: dict[str, Any], file: ConfigFile, name: str) -> bool:
    """Whether the value of ``name`` is the file's (identity first: a NaN is not equal to itself)."""
    value, in_file = values.get(name), file.values.get(name)
    return value is in_file or value == in_file


def _param_name(command: click.Command, option: str | None) -> str | None:
    if option is None:
        return None
    param = file_params(command).get(_normalize(option))
    return None if param is None else param.name


def redact(name: str, value: Any) -> Any:
    """``value`` fit to print: a URL's password is replaced by ***."""
    return redact_url(value) if name in URL_OPTIONS and isinstance(value, str) else value


def format_settings(values: dict[str, Any], command: click.Command) -> list[str]:
    """Every option a config file may set, as TOML lines in the command's order, redacted;
    an option without a value is a comment."""
    lines = []
    for param in file_params(command).values():
        assert param.name is not None
        value = redact(param.name, values.get(param.name))
        key = file_key(param)
        lines.append(f"# {key} (not set)" if value is None else f"{key} = {_toml(value)}")
    return lines


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(item) for item in value) + "]"
    return json.dumps(str(value))  # a TOML basic string: JSON's escapes are TOML's
