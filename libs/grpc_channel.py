"""Client channels to other Cachet services: traced, with the same message bounds, TLS when the
caller's settings say so (``cachet.tls``)."""

from __future__ import annotations

import grpc

from cachet.tls import TlsSettings, aio_channel
from cachet.tracing import client_interceptors

_DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def create_channel(
    address: str, max_message_bytes: int = _DEFAULT_MAX_MESSAGE_BYTES, *, tls: TlsSettings | None = None
) -> grpc.aio.Channel:
    """``tls``: the calling service's settings (``settings.tls``); None or no CA file: plaintext."""
    options: list[tuple[str, int | str]] = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # Loopback services restart in tests and in run-local: reconnect quickly.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]
    if spreads_calls(address):
        options.append(("grpc.lb_policy_name", "round_robin"))
    if (authority := list_authority(address)) is not None:
        options.append(("grpc.default_authority", authority))
    return aio_channel(address, tls, options, client_interceptors())


def spreads_calls(address: str) -> bool:
    """Whether calls go round robin over every address the target names: an ``ipv4:a,b`` list
    (run-local's routers) or a ``dns:///name:port`` target (a headless Service's pods, as the Helm
    chart points the bridge at several routers), whose addresses the resolver looks up again
    whenever a connection drops. Not for one ``host:port``: round robin fails a call at once while
    its only connection waits out a reconnect backoff, where pick-first tries again."""
    return "," in address or address.startswith("dns:")


def list_authority(address: str) -> str | None:
    """The authority of an ``ipv4:a,b`` (or ``ipv6:``) list: its first address. gRPC's own is the
    whole list, which is also the name TLS checks every server's certificate against, and which
    no certificate names ("Hostname Verification Check failed"). gRPC checks one name for every
    address of a channel: the servers of a list must all be certified for the first one's host
    (routers sharing one certificate are, as run-local's all name 127.0.0.1; routers with a
    certificate each go behind a ``dns:///`` name that each certificate carries). None: gRPC's
    own authority is already the host to check (one address, a ``dns:`` name)."""
    scheme, _, listed = address.partition(":")
    if scheme not in ("ipv4", "ipv6") or "," not in listed:
        return None
    return listed.split(",")[0]
