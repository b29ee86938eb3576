"""``wstream-server --config FILE``: the server's settings in TOML.

The keys are :class:`ServerConfig`'s field names, so the file and the dataclass cannot drift apart:
a flag ``--memory-limit`` is the key ``memory_limit``, and durations in seconds carry ``_s``
(``--lease`` is ``lease_s``). ``log_level`` is the one key that is not a field. Sizes may be
written as on the command line (``memory_limit = "64GiB"``). Flags given on the command line
override the file. An unknown key or a value of the wrong type is an error naming the file and key.

```toml
bind = ["ipc:///run/wstream/wstream.sock", "tcp://0.0.0.0:5555"]
admin_secret_file = "/etc/wstream/admin.secret"
memory_limit = "64GiB"
store = "/var/lib/wstream"
snapshot_every = 500
metrics_port = 9464
```
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from collections.abc import Callable
from typing import Any

import msgspec

from wstream.protocol import parse_size

from .config import ServerConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

SIZE_FIELDS = frozenset({"memory_limit", "snapshot_buffer"})
"""Fields that take a byte size: a string like "64GiB" is read as the flag reads it."""
EXTRA_KEYS: dict[str, Any] = {"log_level": str}
"""Keys that are flags of ``wstream-server`` but not fields of ServerConfig."""


def setting_types() -> dict[str, Any]:
    """Every key a config file may hold, with its type."""
    hints = typing.get_type_hints(ServerConfig)
    return {**{f.name: hints[f.name] for f in dataclasses.fields(ServerConfig)}, **EXTRA_KEYS}


def default_of(name: str) -> Any:
    """The default of ServerConfig field ``name`` (for flags' defaults and help)."""
    f = ServerConfig.__dataclass_fields__[name]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def read_config_file(path: str) -> dict[str, Any]:
    """The settings in TOML file ``path``, each key known and each value of its field's type."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ValueError(f"cannot read the config file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path} is not valid TOML: {exc}") from None
    types = setting_types()
    unknown = sorted(set(data) - set(types))
    if unknown:
        raise ValueError(
            f"{path}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
            f"the keys are ServerConfig's field names: {', '.join(sorted(types))}"
        )
    return {key: _convert(path, key, value, types[key]) for key, value in data.items()}


def _convert(path: str, key: str, value: Any, typ: Any) -> Any:
    if key in SIZE_FIELDS and isinstance(value, str):
        try:
            return parse_size(value)
        except ValueError as exc:
            raise ValueError(f"{path}: {key}: {exc}") from None
    try:
        return msgspec.convert(value, typ)
    except msgspec.ValidationError as exc:
        raise ValueError(f"{path}: {key} = {value!r}: {exc}") from None


def flag_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Config key -> the parser's action for it (by the naming rule in the module docstring)."""
    keys = setting_types()
    out: dict[str, argparse.Action] = {}
    for action in parser._actions:
        for key in (action.dest, f"{action.dest}_s"):
            if key in keys:
                out[key] = action
    return out


def given_on_command_line(build_parser: Callable[[], argparse.ArgumentParser], argv: list[str] | None) -> set[str]:
    """The dests of the flags ``argv`` gives (parsed again with every default suppressed)."""
    quiet = build_parser()
    for action in quiet._actions:
        action.default = argparse.SUPPRESS
    return set(vars(quiet.parse_args(argv)))


def apply_config_file(
    args: argparse.Namespace, argv: list[str] | None, build_parser: Callable[[], argparse.ArgumentParser]
) -> set[str]:
    """Fill ``args`` from ``args.config`` (if given) wherever the command line did not give the
    flag; then the usual ``config_from_args`` makes the ServerConfig. Returns the keys whose value
    came from the file (so that an error about one can say so). ValueError when the file is wrong."""
    if args.config is None:
        return set()
    values = read_config_file(args.config)
    actions = flag_actions(build_parser())
    given = given_on_command_line(build_parser, argv)
    applied = set()
    for key, value in values.items():
        action = actions.get(key)
        if action is None:
            raise AssertionError(f"the setting {key!r} has no wstream-server flag (a bug in wstream: each needs one)")
        if action.choices is not None and value not in action.choices:
            raise ValueError(f"{args.config}: {key} = {value!r}: choose one of {', '.join(map(str, action.choices))}")
        if action.dest not in given:
            setattr(args, action.dest, value)
            applied.add(key)
    return applied


def setting_names(parser: argparse.ArgumentParser, from_file: set[str], path: str | None) -> Callable[[str], str]:
    """How ``wstream-server`` names a setting in an error: its flag and its config key, and the file
    it was read from (``from_file``: keys taken from the config file ``path``)."""
    actions = flag_actions(parser)

    def name(key: str) -> str:
        where = f", set in {path}" if key in from_file else ""
        action = actions.get(key)
        if action is None or not action.option_strings:
            return f"config key {key}{where}"
        return f"{action.option_strings[0]} (config key {key}{where})"

    return name
