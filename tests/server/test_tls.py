"""HTTPS: the server with --ssl-keyfile / --ssl-certfile answers over TLS only, client
certificates checked where --ssl-cert-reqs asks; bad TLS flags stop before the model
loads (certificates from trustme, a test CA)."""

from __future__ import annotations

import ssl
import urllib.error
import urllib.request

import pytest

from tests.server.conftest import start_server, trusting, write_tls_files
from tests.test_cli import assert_one_line_error, pdserve

pytest.importorskip("trustme")


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    return folder, write_tls_files(folder)


@pytest.fixture(scope="module")
def tls_server(tls_files):
    folder, ca = tls_files
    server = start_server("--ssl-keyfile", str(folder / "key.pem"), "--ssl-certfile",
                          str(folder / "cert.pem"), client_tls=trusting(ca))
    yield server
    server.stop()


def test_the_openai_client_talks_https(tls_server):
    assert tls_server.url.startswith("https://")
    # ignore_eos: sampled, the random model may draw its EOS before the fourth token
    out = tls_server.openai().completions.create(model="tiny", prompt="hi", max_tokens=4,
                                                 extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 4
    assert "serving 'tiny' on https://" in tls_server.log_text()


def test_plain_http_gets_no_answer(tls_server):
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"http://127.0.0.1:{tls_server.port}/health", timeout=10)


def test_a_client_that_does_not_trust_the_certificate_is_refused(tls_server):
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        urllib.request.urlopen(tls_server.url + "/health", timeout=10,
                               context=ssl.create_default_context())


def test_client_certificates_required(tls_files):
    folder, ca = tls_files
    flags = ("--ssl-keyfile", str(folder / "key.pem"), "--ssl-certfile",
             str(folder / "cert.pem"), "--ssl-ca-certs", str(folder / "ca.pem"),
             "--ssl-cert-reqs", "2")
    server = start_server(*flags, client_tls=trusting(ca, folder / "client.pem"))
    try:
        assert server.request("GET", "/health")[0] == 200
        with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError)):
            urllib.request.urlopen(server.url + "/health", timeout=10, context=trusting(ca))
    finally:
        server.stop()


@pytest.mark.parametrize(("flags", "why"), [
    (("--ssl-keyfile", "k.pem"), "--ssl-keyfile and --ssl-certfile go together"),
    (("--ssl-cert-reqs", "2"), "--ssl-ca-certs and --ssl-cert-reqs need --ssl-keyfile"),
])
def test_tls_flags_that_do_not_fit_together(flags, why):
    assert_one_line_error(pdserve("serve", "tiny", *flags), why)


@pytest.mark.parametrize("command", [("serve", "tiny"), ("gateway",)])
def test_a_key_file_that_is_missing_stops_before_anything_starts(command, tls_files,
                                                                  tmp_path):
    folder, _ = tls_files
    result = pdserve(*command, "--ssl-keyfile", str(tmp_path / "absent.pem"),
                     "--ssl-certfile", str(folder / "cert.pem"))
    assert_one_line_error(result, "cannot be loaded")
    assert "model loaded" not in result.stderr


def test_a_pd_instance_stays_on_plain_http(tls_files):
    folder, _ = tls_files
    result = pdserve("serve", "tiny", "--role", "prefill", "--ssl-keyfile",
                     str(folder / "key.pem"), "--ssl-certfile", str(folder / "cert.pem"))
    assert_one_line_error(result, "--role with --ssl-certfile", "plain HTTP")
