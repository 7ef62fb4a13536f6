"""API keys from the environment and from a key file: accepted, compared exactly, never
shown on the command line or in the log."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from pdserve.server.auth import APIKeyFileError, is_authorized, load_api_keys

openai = pytest.importorskip("openai")

ENV_KEY = "sk-env-5d1c7a"
FILE_KEYS = ("sk-file-one-93b2", "sk-file-two-41e7")


def test_keys_come_from_every_source_and_only_a_bearer_token_matches(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"# team keys\n{FILE_KEYS[0]}\n\n  {FILE_KEYS[1]}  \n")
    keys = load_api_keys("sk-flag", str(path), {"PDSERVE_API_KEY": ENV_KEY})
    assert keys == tuple(k.encode() for k in ("sk-flag", ENV_KEY, *FILE_KEYS))
    assert is_authorized(f"Bearer {FILE_KEYS[1]}", keys)
    assert is_authorized(f"bearer {ENV_KEY}", keys)
    for header in ("", FILE_KEYS[0], f"Bearer {FILE_KEYS[0]}x", f"Basic {FILE_KEYS[0]}",
                   "Bearer # team keys", "Bearer "):
        assert not is_authorized(header, keys), header
    assert load_api_keys(None, None, {}) == ()


def test_an_unreadable_or_empty_key_file_is_an_error(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("# nothing here\n\n")
    for path in (empty, tmp_path / "missing"):
        with pytest.raises(APIKeyFileError, match=str(path)):
            load_api_keys(None, str(path), {})


def test_the_server_refuses_to_start_with_a_bad_key_file(tmp_path):
    missing = tmp_path / "missing"
    done = subprocess.run([sys.executable, "-m", "pdserve", "serve", "tiny", "--device", "cpu",
                           "--api-key-file", str(missing)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0 and "cannot read the API key file" in done.stderr


@pytest.fixture(scope="module")
def keyed(launch, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys"
    path.write_text("\n".join(FILE_KEYS) + "\n")
    return launch("--api-key-file", str(path), env={"PDSERVE_API_KEY": ENV_KEY},
                  client_key=ENV_KEY)


def test_every_configured_key_works_and_others_get_401(keyed):
    for key in (ENV_KEY, *FILE_KEYS):
        client = openai.OpenAI(base_url=keyed.url + "/v1", api_key=key, max_retries=0)
        assert client.completions.create(model="tiny", prompt="x", max_tokens=1).choices
    wrong = openai.OpenAI(base_url=keyed.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="tiny", prompt="x", max_tokens=1)
    for path, body in (("/tokenize", {"prompt": "x"}),
                       ("/invocations", {"model": "tiny", "prompt": "x", "max_tokens": 1}),
                       ("/reset_prefix_cache", b""),
                       ("/rerank", {"query": "q", "documents": ["d"]}),
                       ("/score", {"text_1": "a", "text_2": "b"})):
        status, _, _ = keyed.request("POST", path, body,
                                     headers={"Authorization": "Bearer sk-wrong"})
        assert status == 401, path
    assert keyed.request("POST", "/invocations", {"model": "tiny", "prompt": "x",
                                                  "max_tokens": 1})[0] == 200
    assert keyed.request("POST", "/reset_prefix_cache", b"")[0] == 200
    for path in ("/health", "/ping"):  # open, for probes
        assert keyed.request("GET", path, headers={"Authorization": ""})[0] == 200


def test_the_terminal_clients_send_the_key_from_the_flag_or_the_environment(keyed,
                                                                            monkeypatch):
    from pdserve.cli import build_parser
    from pdserve.client_cli import run_complete

    def complete(*flags: str) -> int:
        args = build_parser().parse_args(["complete", "--url", keyed.url + "/v1",
                                          "--max-tokens", "2", *flags, "-q", "x"])
        return run_complete(args, io.StringIO(), io.StringIO())

    for name in ("PDSERVE_API_KEY", "OPENAI_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    assert complete("--model-name", "tiny") == 1  # no key: 401, reported
    assert complete("--model-name", "tiny", "--api-key", FILE_KEYS[0]) == 0
    monkeypatch.setenv("OPENAI_API_KEY", FILE_KEYS[1])
    assert complete() == 0  # the model found through /v1/models, with the key


def test_keys_are_not_on_the_command_line_or_in_the_log(keyed):
    with open(f"/proc/{keyed.process.pid}/cmdline", "rb") as f:
        cmdline = f.read().decode()
    log = keyed.log_text()
    assert "3 key(s) accepted" in log  # the count, not the keys
    for key in (ENV_KEY, *FILE_KEYS):
        assert key not in cmdline and key not in log
