"""Server flags: where the HTTP server listens and how it treats clients.

Kept apart from ``EngineConfig`` because the engine never reads them; the field docs are
also ``pdserve serve --help``.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

from pdserve.config import doc
from pdserve.server.cors import CrossOriginConfig
from pdserve.server.reasoning import REASONING_PARSERS
from pdserve.server.tls import TLSConfig


@dataclass(frozen=True)
class ServerConfig(CrossOriginConfig, TLSConfig):
    host: str = doc("0.0.0.0", "Address the HTTP server binds.")
    port: int = doc(8000, "TCP port of the HTTP server.")
    api_key: str | None = field(default=None, repr=False, metadata={"help": (
        "If set, every /v1 route (and /tokenize, /detokenize) needs 'Authorization: Bearer "
        "KEY'. A command line is visible to every user of the host (ps): prefer the "
        "PDSERVE_API_KEY environment variable or --api-key-file.")})
    api_key_file: str | None = doc(None, "A file of API keys, one per line (blank lines and "
                                   "lines starting with # are skipped); any of them is "
                                   "accepted, as are --api-key and PDSERVE_API_KEY.")
    cluster_secret: str | None = doc(None, "If set, the internal /pd/ routes (P/D groups) need "
                                     "it in the X-PDServe-Cluster-Secret header; default: "
                                     "$PDSERVE_CLUSTER_SECRET. API keys never open them.")
    served_model_name: tuple[str, ...] | None = doc(
        None, "Model name(s) clients may send; the first is the one responses and /v1/models "
        "carry (default: the model argument as given).")
    chat_template: str | None = doc(None, "Chat template for /v1/chat/completions: a Jinja "
                                    "file, or the template itself; replaces the tokenizer's.")
    enable_auto_tool_choice: bool = doc(False, "Honour tool_choice 'auto': the model's text "
                                        "is searched for tool calls by --tool-call-parser.")
    tool_call_parser: str | None = doc(None, "How tool calls are written in the model's text "
                                       "(tool_choice 'auto'): llama3_json (Llama 3.x) or "
                                       "hermes (<tool_call>, Qwen2.5).",
                                       choices=("llama3_json", "hermes"))
    reasoning_parser: str | None = doc(None, "How a reasoning model's thinking is told from "
                                       "its answer on /v1/chat/completions, put in the "
                                       "message's 'reasoning' and 'reasoning_content': "
                                       "deepseek_r1 (text before </think>: DeepSeek-R1's "
                                       "distills, QwQ, Qwen3 thinking-only models) or qwen3 "
                                       "(a thought only where the output opens with <think>: "
                                       "Qwen3's models that think or not).",
                                       choices=REASONING_PARSERS)
    max_stored_responses: int = doc(1000, "Responses /v1/responses keeps in memory for "
                                    "previous_response_id and GET /v1/responses/{id} (the "
                                    "oldest forgotten first); 0 keeps none. With "
                                    "--api-server-count above 1 none are kept.")
    shutdown_timeout: float = doc(30.0, "On SIGTERM, seconds in-flight requests may run "
                                  "before they are aborted.")
    retry_after: int = doc(1, "Seconds sent in Retry-After when the waiting queue is full.")
    max_request_bytes: int = doc(16 * 1024 * 1024, "Largest HTTP request body accepted.")
    body_timeout_s: float = doc(30.0, "A request's body must arrive within this long (a slow "
                                "or stalled client gets 408).")
    max_concurrent_requests: int = doc(4096, "Requests answered at once, streams included; "
                                       "more get 429 with Retry-After.")
    log_requests: bool = doc(False, "Log one line per finished request.")
    enable_request_id_headers: bool = doc(
        False, "Every answer carries an X-Request-Id header: the request's own X-Request-Id, "
        "else a new one (as vLLM's flag). A request's X-Request-Id (or its 'request_id' "
        "field) names its completion id either way.")
    disable_log_stats: bool = doc(False, "No periodic line of the engine's throughput, "
                                  "queues and KV cache use.")
    log_stats_interval_s: float = doc(10.0, "Seconds between the engine's stats lines "
                                      "(none while the engine stays idle).")
    engine_start_timeout: float = doc(600.0, "Seconds the engine process may take to load "
                                      "the model before the server gives up.")
    engine_restarts: int = doc(3, "When the engine process dies, its requests fail with 503 "
                               "(Retry-After) and a new one is started, up to this many "
                               "times in a row (an engine that ran 60 s starts the count "
                               "again); then the server exits non-zero. 0: never restart.")
    api_server_count: int = doc(1, "HTTP processes in front of the one engine, each with "
                                "its own event loop, all listening on --port (SO_REUSEPORT, "
                                "Linux): for loads where one process's loop is busier than an "
                                "engine step. Above 1, engine restarts are off (a dead engine "
                                "stops the server) and --port must not be 0.")
    engine_restart_backoff_s: float = doc(1.0, "Seconds before the first restart; each "
                                          "further attempt of one outage waits twice as long.")

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser "
                             "(llama3_json or hermes)")
        if self.max_stored_responses < 0:
            raise ValueError(f"--max-stored-responses must be >= 0, not "
                             f"{self.max_stored_responses}")
        if not self.log_stats_interval_s > 0:  # NaN included
            raise ValueError(f"--log-stats-interval-s must be > 0, not "
                             f"{self.log_stats_interval_s}")
        if self.engine_restarts < 0:
            raise ValueError(f"--engine-restarts must be >= 0, not {self.engine_restarts}")
        self._check_api_server_count()
        self.check_tls()
        if not self.engine_restart_backoff_s >= 0:  # NaN included
            raise ValueError(f"--engine-restart-backoff-s must be >= 0, not "
                             f"{self.engine_restart_backoff_s}")

    def _check_api_server_count(self) -> None:
        count = self.api_server_count
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"--api-server-count must be an integer >= 1, not {count!r}")
        if count == 1:
            return
        if not hasattr(socket, "SO_REUSEPORT"):
            raise ValueError(f"--api-server-count {count} needs SO_REUSEPORT (Linux) so that "
                             "every HTTP process can listen on the port; this platform has "
                             "none: use 1")
        if self.port == 0:
            raise ValueError(f"--api-server-count {count} needs a fixed --port (0 would give "
                             "each HTTP process a port of its own)")
