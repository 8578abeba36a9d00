"""TLS for `lantau serve` and `lantau route`: the listeners' certificates (mutual TLS with a
client CA), and the gateway's connections to replicas that speak TLS. PEM files throughout;
each loaded once at start, so a bad one stops the command there, named."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ServerTls:
    """A listener's key and certificate chain; with `ca_certs`, clients must present a
    certificate that CA signed."""

    keyfile: str
    certfile: str
    ca_certs: str | None = None

    @classmethod
    def of(
        cls, keyfile: str | None, certfile: str | None, ca_certs: str | None
    ) -> ServerTls | None:
        """From the --ssl-keyfile / --ssl-certfile / --ssl-ca-certs flags (None: no TLS);
        ValueError naming what does not go together or does not load."""
        if (keyfile is None) != (certfile is None):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together")
        if certfile is None:
            if ca_certs is not None:
                raise ValueError("--ssl-ca-certs needs --ssl-keyfile and --ssl-certfile")
            return None
        tls = cls(keyfile, certfile, ca_certs)
        tls.context()  # loads every file
        return tls

    def context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(self.certfile, self.keyfile)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"--ssl-certfile / --ssl-keyfile: {e}") from None
        if self.ca_certs is not None:
            try:
                context.load_verify_locations(self.ca_certs)
            except (OSError, ssl.SSLError) as e:
                raise ValueError(f"--ssl-ca-certs: {e}") from None
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def grpc_credentials(self):
        import grpc

        ca = Path(self.ca_certs).read_bytes() if self.ca_certs else None
        pair = (Path(self.keyfile).read_bytes(), Path(self.certfile).read_bytes())
        return grpc.ssl_server_credentials(
            [pair], root_certificates=ca, require_client_auth=ca is not None
        )


@dataclass(frozen=True)
class ClientTls:
    """How the gateway reaches replicas over TLS: the CAs it trusts (None: the system's) and
    its own certificate for replicas that ask for one (mutual TLS)."""

    ca_certs: str | None = None
    certfile: str | None = None
    keyfile: str | None = None

    def context(self) -> ssl.SSLContext:
        try:
            context = ssl.create_default_context(cafile=self.ca_certs)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"--backend-ca-certs: {e}") from None
        if self.certfile is not None:
            try:
                context.load_cert_chain(self.certfile, self.keyfile)
            except (OSError, ssl.SSLError) as e:
                raise ValueError(f"--backend-certfile / --backend-keyfile: {e}") from None
        return context

    def grpc_credentials(self):
        import grpc

        def read(path: str | None) -> bytes | None:
            return Path(path).read_bytes() if path else None

        return grpc.ssl_channel_credentials(
            read(self.ca_certs), read(self.keyfile), read(self.certfile)
        )
