"""Settings dataclasses become command lines: one flag per field, each also read from the
environment as ``SERVE_HEALTH_<FIELD>``.

A field declares itself with :func:`setting`; its ``help`` is the one line of documentation it
gets, on ``--help`` and in the docs. Precedence: flag, then environment, then default.
Durations accept ``500ms``, ``3s``, ``1m`` or plain seconds; a negative one (``-1s``) parses, so
that the validation of its field refuses it with its own message, and a value after a flag may
begin with ``-`` and a digit (``--heartbeat-ttl -1s``: argparse would take it for a flag).
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import re
import sys
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from servehealth_common.version import __version__

T = TypeVar("T")

ENV_PREFIX = "SERVE_HEALTH_"
MAX_PORT = 65535

_DURATION = re.compile(r"^\s*(-?)(\d+(?:\.\d+)?|\.\d+)\s*(ms|s|m|h)?\s*$")
#: A value that begins like a negative number: ``-1``, ``-1s``, ``-.5``.
_NEGATIVE_VALUE = re.compile(r"^-[\d.]")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


@dataclasses.dataclass(frozen=True)
class _BadEnv:
    """An environment value that did not parse; an error unless a flag replaces it."""

    message: str


def parse_duration(text: str) -> float:
    """``"500ms"`` -> 0.5, ``"3s"`` -> 3.0, ``"2"`` -> 2.0 (seconds); ``"-1s"`` -> -1.0."""
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"not a duration: {text!r} (use e.g. 500ms, 3s, 1m)")
    sign, number, unit = match.groups()
    seconds = float(number) * _UNITS[unit]
    return -seconds if sign and seconds else seconds


parse_duration.__name__ = "duration"


def split_host_port(address: str) -> tuple[str, int]:
    """``"0.0.0.0:50051"`` -> ``("0.0.0.0", 50051)``; ``"[::]:50051"`` -> ``("::", 50051)``.

    ValueError unless the port is a number 0-65535 (a larger one used to be wrapped by the
    socket layer: 99999 bound 34463).
    """
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not (port.isascii() and port.isdigit()) or not host:
        raise ValueError(f"not a HOST:PORT address: {address!r}")
    if int(port) > MAX_PORT:
        raise ValueError(f"port {int(port)} of {address!r} is not a TCP port (0-{MAX_PORT})")
    return host, int(port)


def check_listen_address(address: str, flag: str) -> None:
    """ValueError naming ``flag`` unless ``address`` is HOST:PORT with a port 0-65535 and, when
    HOST is written as an IP address (digits and dots, or with a colon), a valid one. Whether a
    host name resolves is only known when the port is bound."""
    try:
        host, _ = split_host_port(address)
        if set(host) <= set("0123456789."):
            _check_ip(host, ipaddress.IPv4Address, "IPv4")
        elif ":" in host:
            _check_ip(host, ipaddress.IPv6Address, "IPv6")
    except ValueError as error:
        raise ValueError(f"{flag}: {error}") from None


def _check_ip(host: str, kind: Callable[[str], object], name: str) -> None:
    try:
        kind(host)
    except ValueError:
        raise ValueError(f"{host!r} is not an {name} address") from None


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ValueError(f"not a boolean: {text!r} (use true or false)")


parse_bool.__name__ = "boolean"


def setting(
    default: Any,
    help: str,
    *,
    duration: bool = False,
    choices: Sequence[str] | None = None,
    metavar: str | None = None,
    shown: str | None = None,
    hidden: bool = False,
) -> Any:
    """Declare a settings field with its documentation.

    A field typed ``tuple[str, ...]`` is a repeatable flag (``--namespace a --namespace b``),
    and a comma-separated list in the environment. A field typed ``bool`` is a switch:
    ``--dry-run`` alone means true, ``--dry-run=false`` (or ``--dry-run false``) false.
    ``shown`` replaces the rendered default in help and docs (e.g. "(required)"). ``hidden``:
    accepted but left out of ``--help`` (deprecated flags; the docs still list them).
    """
    return dataclasses.field(
        default=default,
        metadata={
            "help": help,
            "duration": duration,
            "choices": choices,
            "metavar": metavar,
            "shown": shown,
            "hidden": hidden,
        },
    )


def flag_name(field: dataclasses.Field[Any]) -> str:
    return "--" + field.name.replace("_", "-")


def env_name(field: dataclasses.Field[Any]) -> str:
    return ENV_PREFIX + field.name.upper()


def _render_default(field: dataclasses.Field[Any]) -> str:
    if field.metadata.get("shown"):
        return str(field.metadata["shown"])
    value: Any = field.default
    if isinstance(value, tuple):
        return ",".join(value)
    if field.metadata.get("duration"):
        return f"{value * 1000:g}ms" if value < 1 else f"{value:g}s"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def describe(cls: type) -> list[dict[str, str]]:
    """One row per setting (flag, environment variable, default, help): for docs and --help."""
    return [
        {
            "flag": flag_name(f),
            "env": env_name(f),
            "default": _render_default(f),
            "help": f.metadata["help"],
        }
        for f in dataclasses.fields(cls)
    ]


def build_parser(
    cls: type, prog: str, description: str, environ: Mapping[str, str]
) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog=f"Every flag can also be set as an environment variable {ENV_PREFIX}<NAME>, "
        f"e.g. {env_name(dataclasses.fields(cls)[0])}.",
    )
    # Not a setting (no field, no environment variable): not in the generated flag tables.
    parser.add_argument(
        "--version",
        action="version",
        version=f"{prog} {__version__}",
        help="show the program's name and version and exit",
    )
    hints = typing.get_type_hints(cls)
    # The sections of --help: the class's HELP_GROUPS, a title and the first field of each
    # section, in field order (the fields before the first one, or all without: no section).
    starts = {first: title for title, first in getattr(cls, "HELP_GROUPS", ())}
    target: argparse.ArgumentParser | argparse._ArgumentGroup = parser
    for field in dataclasses.fields(cls):
        if field.name in starts:
            target = parser.add_argument_group(starts[field.name])
        _add_setting(target, field, hints[field.name], environ)
    return parser


def _add_setting(
    target: argparse.ArgumentParser | argparse._ArgumentGroup,
    field: dataclasses.Field[Any],
    kind: Any,
    environ: Mapping[str, str],
) -> None:
    """The flag of ``field`` (typed ``kind``), its default from ``environ`` if set there."""
    env = env_name(field)
    help_text = f"{field.metadata['help']} (default: {_render_default(field)}; env {env})"
    if field.metadata.get("hidden"):
        help_text = argparse.SUPPRESS
    metavar = field.metadata.get("metavar") or field.name.upper()
    if typing.get_origin(kind) is tuple:
        # Repeatable: argparse appends to a list; None means "not given on the command line".
        target.add_argument(
            flag_name(field), dest=field.name, action="append", metavar=metavar, help=help_text
        )
        return
    duration = field.metadata.get("duration")
    convert = parse_duration if duration else parse_bool if kind is bool else kind
    default: Any = field.default
    choices = field.metadata.get("choices")
    if env in environ:
        # A bad value is an error only if no flag overrides it (checked in load()).
        try:
            default = convert(environ[env])
            if choices and default not in choices:
                raise ValueError(f"{default!r} is not one of {list(choices)}")
        except ValueError as error:
            default = _BadEnv(f"environment variable {env}: {error}")
    switch: dict[str, Any] = {}
    if kind is bool:  # --flag alone: true
        switch = {"nargs": "?", "const": True}
        metavar = "true|false"
        if help_text is not argparse.SUPPRESS:
            help_text = help_text[:-1] + f"; --no-{flag_name(field)[2:]}: false)"
    target.add_argument(
        flag_name(field),
        dest=field.name,
        type=convert,
        default=default,
        choices=choices,
        metavar=None if choices else metavar,
        help=help_text,
        **switch,
    )
    if kind is bool:  # --no-flag: false
        target.add_argument(
            "--no-" + flag_name(field)[2:],
            dest=field.name,
            action="store_const",
            const=False,
            help=argparse.SUPPRESS,
        )


def _attach_negative_values(argv: Sequence[str], flags: Sequence[str]) -> list[str]:
    """``--flag -1s`` -> ``--flag=-1s``: argparse takes a token that begins with ``-`` for a
    flag unless it is a plain negative number, so ``-1s`` never reached the validation of its
    flag ("expected one argument"). Every flag of a settings class takes one value."""
    result: list[str] = []
    for index, token in enumerate(argv):
        if token == "--":
            return result + list(argv[index:])
        if result and _NEGATIVE_VALUE.match(token) and _takes_value(result[-1], flags):
            result[-1] += f"={token}"  # the value of the flag before it
        else:
            result.append(token)
    return result


def _takes_value(token: str, flags: Sequence[str]) -> bool:
    """``token`` is a flag without its value: a whole flag, or a prefix argparse accepts."""
    if not token.startswith("--") or "=" in token:
        return False
    return token in flags or sum(flag.startswith(token) for flag in flags) == 1


def _fill_repeatable(cls: type, values: dict[str, Any], environ: Mapping[str, str]) -> None:
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if typing.get_origin(hints[field.name]) is not tuple:
            continue
        given = values[field.name]
        if given is not None:
            values[field.name] = tuple(given)
        elif env_name(field) in environ:
            values[field.name] = tuple(
                item.strip() for item in environ[env_name(field)].split(",") if item.strip()
            )
        else:
            values[field.name] = field.default


def load(
    cls: type[T],
    argv: Sequence[str] | None,
    environ: Mapping[str, str],
    prog: str,
    description: str,
) -> T:
    """Build ``cls`` from flags and the environment; exits with a usage error on bad input."""
    parser = build_parser(cls, prog, description, environ)
    flags = [flag_name(field) for field in dataclasses.fields(typing.cast(Any, cls))]
    given = sys.argv[1:] if argv is None else argv
    values = vars(parser.parse_args(_attach_negative_values(given, flags)))
    for value in values.values():
        if isinstance(value, _BadEnv):
            parser.error(value.message)
    _fill_repeatable(cls, values, environ)
    try:
        return cls(**values)
    except ValueError as error:  # __post_init__ validation
        parser.error(str(error))
        raise  # unreachable; parser.error exits
