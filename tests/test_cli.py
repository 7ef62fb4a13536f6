"""The real ``pdserve`` command in a subprocess: flags checked before the model loads, one
line per mistake, hub ids served offline from a local Hugging Face cache."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pdserve.model.testing import write_hub_cache
from tests.server.conftest import Server, free_port, wait_healthy

REPO = "acme/tiny-llama"
# The shapes of a small Llama; the CLI tests run it with --load-format dummy (seeded weights).
TINY_CONFIG = {"model_type": "llama", "vocab_size": 320, "hidden_size": 64,
               "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "max_position_embeddings": 256, "bos_token_id": 256,
               "eos_token_id": 257}
GENERATION_CONFIG = {"max_new_tokens": 5, "temperature": 0.0, "repetition_penalty": 1.1}
REPO_ROOT = Path(__file__).resolve().parents[1]


def pdserve(*args: str, env: dict[str, str] | None = None, timeout: float = 300,
            ) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "pdserve", *args], capture_output=True,
                          text=True, env=full_env, timeout=timeout)


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("pdserve: error: "), result.stderr
    for needle in needles:
        assert needle in lines[0]
    return lines[0]


def assert_usage_error(result: subprocess.CompletedProcess, command: str, needle: str) -> None:
    """argparse's answer: the subcommand's usage, then one error line."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert lines[0].startswith(f"usage: pdserve {command}"), result.stderr
    assert lines[-1].startswith(f"pdserve {command}: error: ") and needle in lines[-1]
    assert "Traceback" not in result.stderr


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Path:
    """A Hugging Face cache holding REPO (config and generation config only)."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    (folder / "config.json").write_text(json.dumps(TINY_CONFIG))
    (folder / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    cache = tmp_path_factory.mktemp("hub")
    write_hub_cache(cache, REPO, folder)
    return cache


def offline(cache: Path) -> dict[str, str]:
    return {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}


# ---- mistakes: one line, exit code 2, before anything loads --------------------------------


def test_unknown_schedule_shows_usage():
    assert_usage_error(pdserve("serve", "--schedule", "foo"), "serve", "invalid choice: 'foo'")


def test_flag_that_does_not_exist():
    result = pdserve("serve", "tiny", "--pipeline-parallel-size", "2")
    assert result.returncode == 2
    assert "unrecognized arguments: --pipeline-parallel-size 2" in result.stderr.splitlines()[-1]


def test_a_usage_error_comes_before_torch_is_imported():
    """Every subcommand's parser is built for any command line: none may import torch
    (~1 s), or a mistyped flag and ``--help`` wait for it (the profiler's did)."""
    code = ("import sys\nfrom pdserve.cli import main\ntry:\n    main(['serve', '--nope'])\n"
            "except SystemExit:\n    print('torch imported:', 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, timeout=300)
    assert result.stdout.strip() == "torch imported: False", result.stdout + result.stderr


def test_every_subcommand_prints_its_help():
    """argparse expands ``%`` in help texts: a bare one (``90% of requests``) breaks
    ``--help`` of the subcommand whose flag carries it, and nothing else notices."""
    import argparse

    from pdserve.cli import build_parser

    parser = build_parser()
    parser.format_help()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, command in sub.choices.items():
        assert "usage:" in command.format_help(), name


def test_tensor_parallel_size_that_does_not_divide_the_heads():
    assert_one_line_error(pdserve("generate", "tiny", "--prompt", "x",
                                  "--tensor-parallel-size", "3"),
                          "--tensor-parallel-size 3 does not divide the model's 4 attention heads")


def test_mux_sharing_that_names_no_known_option():
    assert_one_line_error(pdserve("serve", "tiny", "--schedule", "multiplex", "--mux-sharing",
                                  "temporal,spacial"),
                          "--mux-sharing 'temporal,spacial'", "unknown: spacial")


@pytest.mark.parametrize("schedule", ["chunked", "multiplex"])
def test_slo_order_without_a_ttft_slo(schedule):
    assert_one_line_error(pdserve("serve", "tiny", "--schedule", schedule, "--prefill-order",
                                  "slo"),
                          "--prefill-order slo", "set --ttft-slo-ms")


def test_graph_steps_where_no_graphs_are_captured():
    """The CPU captures no prefill-step graphs: the flag stops before the model loads."""
    assert_one_line_error(pdserve("serve", "tiny", "--device", "cpu", "--schedule", "multiplex",
                                  "--mux-graph-step-tokens", "256"),
                          "--mux-graph-step-tokens 256", "on the CPU")


def test_model_given_twice_and_different():
    assert_usage_error(pdserve("generate", "tiny", "--model", "tiny-qwen2", "--prompt", "x"),
                       "generate", "disagree")


def test_port_in_use():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = pdserve("serve", "tiny", "--host", "127.0.0.1", "--port", str(port))
    assert_one_line_error(result, f"--port {port}", "cannot listen")


def test_missing_kazoo_for_zk_registry(tmp_path):
    # A kazoo that fails to import stands in for an install without the cluster extra.
    (tmp_path / "kazoo").mkdir()
    (tmp_path / "kazoo" / "__init__.py").write_text("raise ImportError('no kazoo here')\n")
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO_ROOT}"}
    gateway = pdserve("gateway", "--registry", "zk://127.0.0.1:1", "--port", str(free_port()),
                      env=env)
    assert_one_line_error(gateway, "zk://127.0.0.1:1", "pdserve[cluster]")
    serve = pdserve("serve", "tiny", "--role", "prefill", "--kv-transfer-port", "0",
                    "--registry", "zk://127.0.0.1:1", "--port", str(free_port()), env=env)
    assert_one_line_error(serve, "kazoo")


def test_missing_aiohttp_cors_stops_before_anything_starts(tmp_path):
    # An aiohttp_cors that fails to import stands in for an install that lacks it.
    (tmp_path / "aiohttp_cors").mkdir()
    (tmp_path / "aiohttp_cors" / "__init__.py").write_text("raise ImportError('not here')\n")
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO_ROOT}"}
    for command in (("serve", "tiny"), ("gateway",)):
        result = pdserve(*command, "--port", str(free_port()), env=env)
        assert_one_line_error(result, "aiohttp-cors is not installed")
        assert "model loaded" not in result.stderr


@pytest.mark.parametrize("schedule", ["prefill-first", "chunked", "multiplex", "disagg"])
def test_every_schedule_with_a_role_starts_or_is_refused_in_one_line(schedule):
    """Disaggregation already hands KV between its own pools: a P/D role is refused before
    the model loads. The other schedules pass this check (they serve both roles)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = pdserve("serve", "tiny", "--schedule", schedule, "--role", "decode",
                         "--kv-transfer-port", "0", "--registry", "zk://127.0.0.1:1",
                         "--host", "127.0.0.1", "--port", str(port))
    if schedule == "disagg":
        assert_one_line_error(result, "cannot serve a P/D role")
    else:  # past the role check: stopped by the next one, the port in use
        assert_one_line_error(result, f"--port {port}", "cannot listen")


def test_chat_template_file_that_does_not_exist(tmp_path):
    missing = tmp_path / "nope.jinja"
    result = pdserve("serve", "tiny", "--chat-template", str(missing), "--port", str(free_port()))
    assert_one_line_error(result, str(missing), "does not exist")


def test_chat_template_with_a_syntax_error():
    result = pdserve("serve", "tiny", "--chat-template", "{% for m in messages %}",
                     "--port", str(free_port()))
    assert_one_line_error(result, "chat template")


def test_unknown_preset_or_folder():
    assert_one_line_error(pdserve("generate", "tinyy", "--prompt", "x"), "unknown model 'tinyy'")


def test_hub_id_missing_from_the_offline_cache(hub):
    result = pdserve("generate", "acme/absent", "--prompt", "x", env=offline(hub))
    assert_one_line_error(result, "'acme/absent'", "not in the Hugging Face cache")


def test_generation_config_folder_without_the_file(tmp_path):
    result = pdserve("generate", "tiny", "--prompt", "x", "--generation-config", str(tmp_path))
    assert_one_line_error(result, "no generation_config.json")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine w/o GPU")
def test_cuda_device_without_a_gpu():
    assert_one_line_error(pdserve("generate", "tiny", "--prompt", "x", "--device", "cuda"),
                          "no CUDA GPU")


def test_cluster_checks_its_model_before_starting_instances():
    assert_one_line_error(pdserve("cluster", "tinyy", "--port", str(free_port())),
                          "unknown model 'tinyy'")
    assert_usage_error(pdserve("cluster", "tiny", "--model", "tiny-qwen2"), "cluster",
                       "disagree")


def test_generate_flags_win_over_the_generation_config(hub, monkeypatch):
    from huggingface_hub import constants

    from pdserve.cli import _check_engine_args, _generate_sampling, build_parser

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    argv = ["generate", REPO, "--prompt", "x", "--top-p", "0.5", "--download-dir", str(hub)]
    args = build_parser().parse_args(argv)
    _check_engine_args(args)
    # max_tokens and temperature from generation_config.json, top_p from the flag,
    # top_k from generate's own defaults; repetition_penalty is not applied.
    assert _generate_sampling(args) == {"max_tokens": 5, "temperature": 0.0, "top_p": 0.5,
                                        "top_k": -1}


def test_debug_shows_the_traceback(hub):
    result = pdserve("generate", "acme/absent", "--prompt", "x", "--debug", env=offline(hub))
    assert result.returncode != 0
    assert "Traceback (most recent call last)" in result.stderr
    assert "ModelNotFoundError" in result.stderr


# ---- hub ids, offline -----------------------------------------------------------------------


def test_generate_by_hub_id_equals_by_folder(hub):
    snapshot = next((hub / "models--acme--tiny-llama" / "snapshots").iterdir())
    flags = ["--prompt", "hello", "--max-tokens", "8", "--temperature", "0", "--ignore-eos",
             "--load-format", "dummy", "--device", "cpu", "--generation-config", "vllm"]
    with ThreadPoolExecutor(2) as pool:  # two processes side by side: each mostly loads torch
        by_id, by_folder = pool.map(lambda model: pdserve("generate", model, *flags,
                                                          env=offline(hub)),
                                    [REPO, str(snapshot)])
    assert by_id.returncode == 0, by_id.stderr
    assert by_id.stdout == by_folder.stdout and "(length)" in by_id.stdout


def test_serve_hub_id_with_names_template_and_generation_config(hub, tmp_path):
    """Served names, a chat template file and the generation config's defaults, over HTTP."""
    template = tmp_path / "plain.jinja"
    template.write_text("X{{ messages[0]['content'] }}Y")
    port = free_port()
    log = tempfile.TemporaryFile()
    cmd = [sys.executable, "-m", "pdserve", "serve", "--model", REPO, "--load-format", "dummy",
           "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", "first", "second", "--chat-template", str(template)]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **offline(hub)}
    server = Server(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env),
                    port, log=log)
    try:
        wait_healthy(server)
        _check_served(server)
    finally:
        server.stop()
    assert server.log_text().count("repetition_penalty=1.1 not supported") == 1


def _check_served(server: Server) -> None:
    status, _, body = server.request("GET", "/v1/models")
    assert status == 200
    assert [card["id"] for card in json.loads(body)["data"]] == ["first", "second"]
    chat = {"model": "second", "messages": [{"role": "user", "content": "hello"}],
            "ignore_eos": True}
    status, _, body = server.request("POST", "/v1/chat/completions", chat)
    answer = json.loads(body)
    assert status == 200, answer
    assert answer["model"] == "first"
    # max_new_tokens 5 from generation_config.json; "XhelloY" is 7 byte tokens + BOS.
    assert answer["usage"]["completion_tokens"] == 5
    assert answer["usage"]["prompt_tokens"] == 8
    status, _, body = server.request("POST", "/v1/chat/completions", {**chat, "max_tokens": 3})
    assert json.loads(body)["usage"]["completion_tokens"] == 3  # a request's own value wins
    status, _, body = server.request("POST", "/v1/chat/completions", {**chat, "model": "x"})
    assert status == 400 and json.loads(body)["error"]["code"] == "model_not_found"


# ---- progress bars --------------------------------------------------------------------------


def _on_a_terminal(*args: str) -> str:
    """stderr of ``pdserve ARGS`` when it is a terminal (a pseudo-terminal here)."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    # A new pseudo-terminal is 0 columns wide; a real one has a size.
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    process = subprocess.Popen([sys.executable, "-m", "pdserve", *args], env=env,
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:  # EIO: the process closed its end
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert process.wait(timeout=300) == 0, b"".join(chunks).decode(errors="replace")
    return b"".join(chunks).decode(errors="replace")


def test_weight_loading_bar_only_for_a_person(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**{k: v for k, v in TINY_CONFIG.items()
                                         if k != "model_type"})
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    args = ["generate", str(tmp_path), "--prompt", "x", "--max-tokens", "2", "--device", "cpu"]
    with ThreadPoolExecutor(3) as pool:  # three processes side by side: each mostly loads torch
        shown, quiet = pool.submit(_on_a_terminal, *args), pool.submit(_on_a_terminal, *args,
                                                                       "--quiet")
        piped = pool.submit(pdserve, *args)
        shown, quiet, piped = shown.result(), quiet.result(), piped.result()
    assert "loading weights" in shown
    assert "loading weights" not in quiet
    assert piped.returncode == 0 and "loading weights" not in piped.stderr


def test_serve_reads_its_flags_from_a_config_file(tmp_path):
    """``--config``: the server started from a YAML file, a command-line flag winning."""
    port, other = free_port(), free_port()
    flags = tmp_path / "serve.yaml"
    flags.write_text(f"model: tiny\ndevice: cpu\nhost: 127.0.0.1\nport: {other}\n"
                     "served-model-name: [from-file, alias]\nmax-model-len: 256\n")
    log = tempfile.TemporaryFile()
    cmd = [sys.executable, "-m", "pdserve", "serve", "--config", str(flags), "--port", str(port)]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    server = Server(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env),
                    port, log=log)
    try:
        wait_healthy(server)
        status, _, body = server.request("GET", "/v1/models")
        cards = json.loads(body)["data"]
        assert status == 200 and [card["id"] for card in cards] == ["from-file", "alias"]
        assert cards[0]["max_model_len"] == 256
    finally:
        server.stop()


def test_a_config_file_key_that_is_no_flag(tmp_path):
    flags = tmp_path / "serve.yaml"
    flags.write_text("model: tiny\npipeline-parallel-size: 2\n")
    assert_usage_error(pdserve("serve", "--config", str(flags)), "serve",
                       "'pipeline-parallel-size' is not a flag of pdserve serve")
