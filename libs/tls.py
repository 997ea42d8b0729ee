"""TLS for every Cachet listener and every call between services, built in one place.

One identity per process, from ``CACHET_TLS_*`` (``TlsSettings``, a field of every service's
settings):

- ``CACHET_TLS_CERT_FILE`` / ``CACHET_TLS_KEY_FILE`` (PEM): set, the service's gRPC server
  (``create_server``) or the bridge's uvicorn serves TLS with them.
- ``CACHET_TLS_CA_FILE`` (PEM bundle): set, every gRPC call the service makes uses TLS and
  verifies the server against it (the address's host must be in the server certificate's
  names: an IP address as an IP SAN), presenting the client certificate below, which is what
  mutual TLS needs.
- ``CACHET_TLS_CLIENT_CERT_FILE`` / ``CACHET_TLS_CLIENT_KEY_FILE``: the certificate the service
  presents when it calls; unset, the server pair (a certificate good for both server and
  client authentication). The bridge, whose REST certificate is usually a public CA's, sets
  its internal one here.
- ``CACHET_TLS_CLIENT_AUTH=true``: the listener asks every caller for a certificate signed by
  ``CACHET_TLS_CA_FILE`` and refuses the handshake without one.
- ``CACHET_<SERVICE>_TLS_CERT_FILE`` / ``_KEY_FILE`` (``CACHET_ROUTER_TLS_CERT_FILE``): that
  service's own identity in place of the shared pair (``TlsSettings.for_service``), for
  serving and, without a client pair, for calling: every service signed by the one CA, each
  under its own name. A client-authenticating listener takes any certificate the CA signed,
  whichever service it names (no allow-list of peer names).
- ``CACHET_TLS_ALLOW_PLAINTEXT=true``: plaintext beyond loopback, for a network that encrypts
  and authenticates itself (a service mesh's sidecars). Without it, a service asked to listen
  on any other host than loopback without a certificate refuses to start.

A gRPC service's Prometheus /metrics (``metrics_endpoint``) follows its gRPC port: HTTPS with
the same certificate (``server_ssl_context``), a client certificate required under
``CACHET_TLS_CLIENT_AUTH`` (Prometheus presents its own through its scrape's ``tls_config``),
plaintext on loopback only.
"""

from __future__ import annotations

import ipaddress
import os
import ssl
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from pydantic import model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class PlaintextRefused(ValueError):
    """A listener beyond loopback without TLS and without the operator's explicit consent."""


class TlsSettings(BaseSettings):
    """The process's TLS files and switches (``CACHET_TLS_*``, shared by every service)."""

    model_config = SettingsConfigDict(env_prefix="CACHET_TLS_", frozen=True, extra="ignore")

    cert_file: Path | None = None
    key_file: Path | None = None
    ca_file: Path | None = None
    client_cert_file: Path | None = None
    client_key_file: Path | None = None
    client_auth: bool = False
    allow_plaintext: bool = False

    @model_validator(mode="after")
    def _complete(self) -> TlsSettings:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("CACHET_TLS_CERT_FILE and CACHET_TLS_KEY_FILE are set together")
        if (self.client_cert_file is None) != (self.client_key_file is None):
            raise ValueError("CACHET_TLS_CLIENT_CERT_FILE and CACHET_TLS_CLIENT_KEY_FILE are set together")
        if self.client_auth and (self.cert_file is None or self.ca_file is None):
            raise ValueError(
                "CACHET_TLS_CLIENT_AUTH needs CACHET_TLS_CERT_FILE (the listener serves TLS) and "
                "CACHET_TLS_CA_FILE (what signs the clients' certificates)"
            )
        return self

    @classmethod
    def for_service(cls, env_prefix: str) -> TlsSettings:
        """The shared ``CACHET_TLS_*``, with the pair under ``<env_prefix>TLS_CERT_FILE`` /
        ``_KEY_FILE`` (``CACHET_ROUTER_TLS_...``) in its place where the service has its own."""
        variables = (f"{env_prefix}TLS_CERT_FILE", f"{env_prefix}TLS_KEY_FILE")
        cert, key = (os.environ.get(variable) for variable in variables)
        if cert is None and key is None:
            return cls()
        if cert is None or key is None:
            raise ValueError(f"{' and '.join(variables)} are set together")
        return cls(cert_file=Path(cert), key_file=Path(key))

    @property
    def serves_tls(self) -> bool:
        return self.cert_file is not None

    @property
    def calls_tls(self) -> bool:
        return self.ca_file is not None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_listener(host: str, tls: TlsSettings, service: str = "service") -> None:
    """Refuse plaintext on anything but loopback unless the operator said otherwise."""
    if tls.serves_tls or tls.allow_plaintext or is_loopback(host):
        return
    raise PlaintextRefused(
        f"the {service} refuses to listen in plaintext on {host!r}, which is not loopback: set "
        "CACHET_TLS_CERT_FILE and CACHET_TLS_KEY_FILE, listen on 127.0.0.1, or set "
        "CACHET_TLS_ALLOW_PLAINTEXT=true where the network itself encrypts and authenticates"
    )


def add_port(server: grpc.aio.Server, host: str, port: int, tls: TlsSettings) -> int:
    """Bind ``host:port`` (TLS when the settings have a certificate); the bound port, 0 on failure."""
    check_listener(host, tls, "gRPC server")
    address = f"{host}:{port}"
    if not tls.serves_tls:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, server_credentials(tls))


def server_credentials(tls: TlsSettings) -> grpc.ServerCredentials:
    assert tls.cert_file is not None and tls.key_file is not None
    pair = (tls.key_file.read_bytes(), tls.cert_file.read_bytes())
    if not tls.client_auth:
        return grpc.ssl_server_credentials([pair])
    assert tls.ca_file is not None
    return grpc.ssl_server_credentials(
        [pair], root_certificates=tls.ca_file.read_bytes(), require_client_auth=True
    )


def channel_credentials(tls: TlsSettings) -> grpc.ChannelCredentials | None:
    """None: plaintext (no CA to verify servers with)."""
    if not tls.calls_tls:
        return None
    assert tls.ca_file is not None
    cert, key = _client_pair(tls)
    return grpc.ssl_channel_credentials(
        root_certificates=tls.ca_file.read_bytes(),
        private_key=key.read_bytes() if key is not None else None,
        certificate_chain=cert.read_bytes() if cert is not None else None,
    )


def aio_channel(
    address: str,
    tls: TlsSettings | None,
    options: Sequence[tuple[str, Any]] = (),
    interceptors: Sequence[grpc.aio.ClientInterceptor] | None = None,
) -> grpc.aio.Channel:
    credentials = channel_credentials(tls) if tls is not None else None
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)


# A probe polls a server that is still starting: gRPC's default reconnect backoff (1 s, growing
# by 1.6x) would let it notice a server up for seconds already (measured: an engine serving
# after 6 s was seen after 9.5 s).
# Each probe's channel gets its own connection: channels with the same target and options
# otherwise share one from gRPC's global subchannel pool, so a failure seen while the server was
# down could carry over to later probes (suspected in one loaded run, where a restarted engine
# its peers already reached stayed unhealthy to run-local's probe for 240 s).
_PROBE_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
    ("grpc.use_local_subchannel_pool", 1),
]


def blocking_channel(address: str, tls: TlsSettings | None) -> grpc.Channel:
    """A synchronous channel (probes and scripts, not services)."""
    credentials = channel_credentials(tls) if tls is not None else None
    if credentials is None:
        return grpc.insecure_channel(address, options=_PROBE_OPTIONS)
    return grpc.secure_channel(address, credentials, options=_PROBE_OPTIONS)


def uvicorn_options(tls: TlsSettings) -> dict[str, Any]:
    """``uvicorn.Config`` keyword arguments that make it serve HTTPS (none for plaintext)."""
    if not tls.serves_tls:
        return {}
    options: dict[str, Any] = {"ssl_keyfile": str(tls.key_file), "ssl_certfile": str(tls.cert_file)}
    if tls.client_auth:
        options |= {"ssl_ca_certs": str(tls.ca_file), "ssl_cert_reqs": ssl.CERT_REQUIRED}
    return options


def server_ssl_context(tls: TlsSettings) -> ssl.SSLContext:
    """What an HTTPS listener other than uvicorn (a service's /metrics) serves with: the
    certificate of ``server_credentials``, and the same client-certificate rule."""
    assert tls.cert_file is not None and tls.key_file is not None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(tls.cert_file), str(tls.key_file))
    if tls.client_auth:
        context.load_verify_locations(cafile=str(tls.ca_file))
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def http_client_context(tls: TlsSettings) -> ssl.SSLContext | None:
    """What an HTTP client of a Cachet listener verifies it with (None: plain http)."""
    if not tls.calls_tls:
        return None
    context = ssl.create_default_context(cafile=str(tls.ca_file))
    cert, key = _client_pair(tls)
    if cert is not None:
        context.load_cert_chain(str(cert), str(key))
    return context


def _client_pair(tls: TlsSettings) -> tuple[Path | None, Path | None]:
    if tls.client_cert_file is not None:
        return tls.client_cert_file, tls.client_key_file
    return tls.cert_file, tls.key_file
