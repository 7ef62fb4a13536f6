"""HTTPS for the server and the gateway, with vLLM's flags (``TLSConfig``): a key and its
certificate chain, and optionally client certificates checked against given CAs."""

from __future__ import annotations

import ssl
from dataclasses import dataclass

from pdserve.config import doc


@dataclass(frozen=True)
class TLSConfig:
    ssl_keyfile: str | None = doc(None, "The TLS private key (PEM): with --ssl-certfile, "
                                  "it answers HTTPS only.")
    ssl_certfile: str | None = doc(None, "The TLS certificate chain (PEM), with "
                                   "--ssl-keyfile.")
    ssl_ca_certs: str | None = doc(None, "CA certificates (PEM) that client certificates are "
                                   "checked against (--ssl-cert-reqs 1 or 2).")
    ssl_cert_reqs: int = doc(0, "Client certificates: 0 not asked for, 1 checked when sent, "
                             "2 required (as Python's ssl.CERT_NONE, CERT_OPTIONAL, "
                             "CERT_REQUIRED).", choices=(0, 1, 2))

    def check_tls(self) -> None:
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together: give both or "
                             "neither")
        if self.ssl_certfile is None and (self.ssl_ca_certs or self.ssl_cert_reqs):
            raise ValueError("--ssl-ca-certs and --ssl-cert-reqs need --ssl-keyfile and "
                             "--ssl-certfile")
        if self.ssl_cert_reqs and self.ssl_ca_certs is None:
            raise ValueError(f"--ssl-cert-reqs {self.ssl_cert_reqs} needs --ssl-ca-certs: "
                             "the CAs client certificates are checked against")

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context to listen with (None: plain HTTP); a file that is missing or not
        PEM fails here (the command line calls it before anything starts)."""
        if self.ssl_certfile is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.ssl_certfile, self.ssl_keyfile)
        if self.ssl_ca_certs is not None:
            context.load_verify_locations(cafile=self.ssl_ca_certs)
        context.verify_mode = ssl.VerifyMode(self.ssl_cert_reqs)
        return context
