"""The config error and its check helper, shared by every config module."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config file or override is malformed; the message names the key and the fix."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


# The longest duration a command-line flag takes, seconds: a week. gRPC deadlines past ~1e9 s
# overflow (a bare "Deadline Exceeded" at once), and nothing here waits that long on purpose.
MAX_SECONDS = 7 * 24 * 3600.0


def seconds_arg(text: str) -> float:
    """An argparse ``type`` for a duration flag: a finite number of seconds in (0, ``MAX_SECONDS``]
    (argparse names the flag in its error)."""
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (math.isfinite(value) and 0 < value <= MAX_SECONDS):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number of seconds in (0, {MAX_SECONDS:g}]")
    return value


# gRPC target schemes an address may use instead of HOST:PORT (unix:PATH, dns:///HOST:PORT, ...).
_SCHEMES = ("dns", "unix", "unix-abstract", "ipv4", "ipv6", "vsock")


def check_address(address: str, field: str = "address") -> str:
    """``address`` if it is HOST:PORT with a port in 1-65535 (gRPC would take 65536 + P as port
    P) or a gRPC target with a scheme (``unix:PATH``, ``dns:///HOST:PORT``).

    Raises:
        ConfigError: names ``field`` and what is expected.
    """
    host, sep, port = address.rpartition(":")
    if sep and port.isdigit() and host:
        if 1 <= int(port) <= 65535:
            return address
        raise ConfigError(f"{field}: {address!r}: port {port} is not a TCP port (1-65535)")
    if address.split(":", 1)[0] in _SCHEMES and ":" in address:
        return address
    raise ConfigError(f"{field}: {address!r} must be HOST:PORT (e.g. 127.0.0.1:50051)")
