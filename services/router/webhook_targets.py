"""Where a webhook may go: public addresses only, unless the operator allows a network.

A webhook URL is the caller's choice, and the router POSTs to it from inside the
deployment. Unguarded, a caller could make the router call the cloud's metadata
service (169.254.169.254), an admin port on loopback or anything on the private
network (server-side request forgery). So a target's host is resolved, and every
address it resolves to must be public (``ipaddress``'s ``is_global``, not multicast)
or lie in a network the operator allows (``CACHET_ROUTER_WEBHOOK_ALLOWED_NETWORKS``:
internal receivers, and the tests' loopback ones). One refused address refuses the
target: which of several addresses a connection would take is not ours to choose.

The call then connects to the address that was checked, not to a second lookup of
the name, so a DNS answer that changes between check and connect (rebinding) cannot
steer it; the Host header and TLS's SNI and certificate check keep the URL's name.
Targets are checked when a batch is queued (a clear INVALID_ARGUMENT) and again
before every attempt, since DNS answers change in between.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_address, ip_network

import httpx

from cachet.errors import InvalidArgument

Address = IPv4Address | IPv6Address
Network = IPv4Network | IPv6Network
# (host, port) -> the addresses a connection could use; tests pass their own.
Resolver = Callable[[str, int], Awaitable[list[str]]]

_DEFAULT_PORTS = {"http": 80, "https": 443}
# NAT64's well-known prefix carries an IPv4 address in its low 32 bits; behind a NAT64
# gateway 64:ff9b::a00:5 reaches 10.0.0.5, so the embedded address is what is judged.
_NAT64 = ip_network("64:ff9b::/96")


class TargetRefused(InvalidArgument):
    """The URL may never be called: not http(s), no host, or an address that is not public."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="webhook_url")


class TargetUnresolved(Exception):
    """The host did not resolve this time; a later attempt may succeed."""


async def system_resolver(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


@dataclass(frozen=True)
class WebhookTarget:
    """A checked target: the URL as given, and the address the call must connect to."""

    url: httpx.URL
    address: Address

    @property
    def pinned_url(self) -> httpx.URL:
        return self.url.copy_with(host=str(self.address))

    @property
    def headers(self) -> dict[str, str]:
        return {"Host": self.url.netloc.decode("ascii")}

    @property
    def extensions(self) -> dict[str, str]:
        # httpcore sends this name in TLS's SNI and checks the certificate against it.
        return {"sni_hostname": self.url.host} if self.url.scheme == "https" else {}


class WebhookTargets:
    """Resolves webhook URLs and refuses the ones that land anywhere but the public internet."""

    def __init__(
        self, allowed_networks: Sequence[Network] = (), resolver: Resolver = system_resolver
    ) -> None:
        self._allowed = tuple(allowed_networks)
        self._resolve = resolver

    async def resolve(self, url: str) -> WebhookTarget:
        """The target to connect to; TargetRefused (never allowed) or TargetUnresolved (try later)."""
        parsed = _parse(url)
        port = parsed.port or _DEFAULT_PORTS[parsed.scheme]
        try:
            found = await self._resolve(parsed.host, port)
        except OSError as failure:  # socket.gaierror: no such name, or DNS is down
            raise TargetUnresolved(f"{parsed.host} did not resolve: {failure}") from failure
        if not found:
            raise TargetUnresolved(f"{parsed.host} resolved to no address")
        addresses = [_address(text, parsed.host) for text in found]
        for address in addresses:
            if not self.allows(address):
                raise TargetRefused(
                    f"webhook_url's host {parsed.host} resolves to {address}, which is not a public"
                    " address (loopback, private, link-local and reserved ranges are refused unless"
                    " the operator allows them)"
                )
        return WebhookTarget(parsed, addresses[0])

    def allows(self, address: Address) -> bool:
        return any(address in network for network in self._allowed) or is_public(address)


def is_public(address: Address) -> bool:
    if isinstance(address, IPv6Address):
        if address.ipv4_mapped is not None:
            return is_public(address.ipv4_mapped)
        if address in _NAT64:
            return is_public(IPv4Address(int(address) & 0xFFFFFFFF))
    return address.is_global and not address.is_multicast


def _parse(url: str) -> httpx.URL:
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as invalid:
        raise TargetRefused(f"webhook_url is not a valid URL: {invalid}") from invalid
    if parsed.scheme not in _DEFAULT_PORTS:
        raise TargetRefused("webhook_url must be an http(s) URL")
    if not parsed.host:
        raise TargetRefused("webhook_url names no host")
    return parsed


def _address(text: str, host: str) -> Address:
    try:
        return ip_address(text)
    except ValueError as odd:
        # An address the resolver gave that ipaddress cannot read (a zone id, say) is not judged safe.
        raise TargetRefused(
            f"webhook_url's host {host} resolves to {text!r}, which is not an IP address"
        ) from odd
