"""Webhook targets: which addresses a webhook may reach.

Loopback targets resolve for real (they stay on this machine); private, link-local
and public ranges come from a resolver seam answering for made-up names. Nothing
here sends a request: resolving a target only names the address a call would use.
"""

from __future__ import annotations

from ipaddress import ip_address, ip_network

import pytest

from cachet.errors import InvalidArgument
from cachet.router.webhook_targets import TargetRefused, TargetUnresolved, WebhookTargets, is_public


def answering(*addresses: str):
    """A resolver that answers ``addresses`` for any name (and records what it was asked)."""
    asked: list[tuple[str, int]] = []

    async def resolve(host: str, port: int) -> list[str]:
        asked.append((host, port))
        return list(addresses)

    resolve.asked = asked  # type: ignore[attr-defined]
    return resolve


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:9/hook",
        "http://127.8.9.10/hook",
        "http://localhost:9/hook",
        "http://[::1]:9/hook",
        "http://0.0.0.0:9/hook",
        "http://[::ffff:127.0.0.1]:9/hook",
    ],
)
async def test_loopback_and_unspecified_targets_are_refused(url: str) -> None:
    with pytest.raises(TargetRefused) as refused:
        await WebhookTargets().resolve(url)
    assert isinstance(refused.value, InvalidArgument) and refused.value.param == "webhook_url"
    assert "not a public address" in refused.value.message


@pytest.mark.parametrize(
    "address",
    [
        "10.0.0.5",
        "172.16.3.4",
        "192.168.1.1",
        "169.254.169.254",  # cloud metadata
        "100.64.0.1",  # carrier-grade NAT
        "fd00::1",  # unique local
        "fe80::1",  # link-local
        "224.0.0.1",  # multicast
        "240.0.0.1",  # reserved
        "64:ff9b::a00:5",  # NAT64 of 10.0.0.5
        "::ffff:10.0.0.5",
    ],
)
async def test_names_that_resolve_to_non_public_addresses_are_refused(address: str) -> None:
    resolver = answering(address)
    with pytest.raises(TargetRefused) as refused:
        await WebhookTargets(resolver=resolver).resolve("https://hooks.internal.test/cachet")
    assert address in refused.value.message or str(ip_address(address)) in refused.value.message
    assert resolver.asked == [("hooks.internal.test", 443)]


async def test_one_private_address_among_public_ones_refuses_the_target() -> None:
    resolver = answering("93.184.216.34", "10.0.0.5")
    with pytest.raises(TargetRefused):
        await WebhookTargets(resolver=resolver).resolve("http://hooks.example.test/x")


async def test_a_public_target_is_pinned_to_the_checked_address_under_its_own_name() -> None:
    resolver = answering("93.184.216.34", "2606:2800:220:1:248:1893:25c8:1946")
    target = await WebhookTargets(resolver=resolver).resolve("https://hooks.example.test:8443/in?x=1")
    assert str(target.pinned_url) == "https://93.184.216.34:8443/in?x=1"
    assert target.headers == {"Host": "hooks.example.test:8443"}
    assert target.extensions == {"sni_hostname": "hooks.example.test"}  # TLS checks the name
    assert resolver.asked == [("hooks.example.test", 8443)]
    v6 = await WebhookTargets(resolver=answering("2606:2800:220:1:248:1893:25c8:1946")).resolve(
        "http://hooks.example.test/in"
    )
    assert str(v6.pinned_url) == "http://[2606:2800:220:1:248:1893:25c8:1946]/in"
    assert v6.headers == {"Host": "hooks.example.test"} and v6.extensions == {}


async def test_the_operators_allow_list_admits_internal_receivers_and_nothing_else() -> None:
    targets = WebhookTargets([ip_network("127.0.0.1/32"), ip_network("10.1.2.0/24")])
    assert str((await targets.resolve("http://127.0.0.1:9/hook")).address) == "127.0.0.1"
    with pytest.raises(TargetRefused):
        await targets.resolve("http://127.0.0.2:9/hook")
    with pytest.raises(TargetRefused):
        await targets.resolve("http://[::1]:9/hook")
    internal = WebhookTargets([ip_network("10.1.2.0/24")], resolver=answering("10.1.2.7"))
    assert str((await internal.resolve("http://receiver.corp.test/")).address) == "10.1.2.7"
    other = WebhookTargets([ip_network("10.1.2.0/24")], resolver=answering("10.1.3.7"))
    with pytest.raises(TargetRefused):
        await other.resolve("http://receiver.corp.test/")


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("ftp://127.0.0.1/x", "http(s)"),
        ("file:///etc/passwd", "http(s)"),
        ("http:///no-host", "no host"),
        ("http://[::1/x", "not a valid URL"),
    ],
)
async def test_urls_that_are_not_http_targets_are_refused_before_any_lookup(url: str, fragment: str) -> None:
    resolver = answering("93.184.216.34")
    with pytest.raises(TargetRefused) as refused:
        await WebhookTargets(resolver=resolver).resolve(url)
    assert fragment in refused.value.message
    assert resolver.asked == []


async def test_a_name_that_does_not_resolve_may_resolve_later() -> None:
    async def failing(host: str, port: int) -> list[str]:
        raise OSError("Name or service not known")

    with pytest.raises(TargetUnresolved):
        await WebhookTargets(resolver=failing).resolve("http://nowhere.test/")
    with pytest.raises(TargetUnresolved):
        await WebhookTargets(resolver=answering()).resolve("http://nowhere.test/")


def test_public_means_globally_routable_unicast() -> None:
    assert is_public(ip_address("93.184.216.34"))
    assert is_public(ip_address("2606:2800:220:1:248:1893:25c8:1946"))
    assert is_public(ip_address("64:ff9b::5db8:d822"))  # NAT64 of 93.184.216.34
    assert not is_public(ip_address("::ffff:192.168.0.1"))
    assert not is_public(ip_address("ff0e::1"))  # global-scope multicast
