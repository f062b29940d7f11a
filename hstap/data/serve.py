"""A tiny OpenAI-compatible server over the embedded HF engine (stdlib `http.server`), for tests and small local runs.

    hstap serve --target TARGET_DIR --port 8000 [--device cuda] [--batch-size 8]

Endpoints: `GET /health` (200 once the model is loaded, with request counters), `GET /v1/models`,
`POST /v1/chat/completions` (non-streaming, n=1: messages -> chat template -> greedy or sampled generation ->
`{"choices": [{"message": {"role": "assistant", "content": ...}, "finish_reason": "stop"|"length"}], "usage": {...}}`).
Request fields used: messages (an assistant's `reasoning_content` too), max_tokens (or max_completion_tokens), temperature
(default 1, 0 = greedy), top_p, seed, chat_template_kwargs. Like SGLang or vLLM run with a reasoning parser, an answer's
thinking comes back as the message's `reasoning_content` where the target's chat template reads that field
(hstap/data/reasoning.py).

Handler threads only parse and queue; one worker thread owns the model and answers whatever requests are waiting
together in one batch (`hstap.data.decode.generate_batch` takes per-row sampling settings), so concurrent clients share
forward passes.

Fault injection for tests: `HSTAP_SERVE_FAIL_FIRST=N` in the environment makes the first N chat requests answer 503
(with `Retry-After: 0`), to exercise client retries.
"""

from __future__ import annotations

import json
import os
import queue
import random
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from hstap.common import HstapError
from hstap.config import at_least


@dataclass(frozen=True)
class ServeConfig:
    target: str
    """Target model directory (HF layout, with its tokenizer and chat template)."""
    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 8000
    """Port to listen on (0 = any free port; the chosen one is printed)."""
    device: str = "cpu"
    """Torch device (cpu, cuda, cuda:1, auto)."""
    dtype: str = field(default="auto", metadata={"choices": ["auto", "fp32", "bf16"]})
    """Compute dtype (auto = bf16 on GPU, fp32 on CPU)."""
    batch_size: int = 8
    """Most requests answered together in one batch."""
    max_new_tokens: int = 2048
    """Cap on max_tokens per request (also the default when a request gives none)."""
    model_name: str | None = None
    """Name listed by /v1/models (default: the target directory's name)."""

    def __post_init__(self):
        at_least("serve", self, ("batch_size", "max_new_tokens"))
        if not 0 <= self.port < 65536:
            raise HstapError(f"serve: port: {self.port} is not a port number")


class _BadRequest(Exception):
    pass


class _Job:
    __slots__ = ("prompt", "max_tokens", "temperature", "top_p", "seed", "done", "result", "error")

    def __init__(self, prompt, max_tokens, temperature, top_p, seed):
        self.prompt, self.max_tokens, self.seed = prompt, max_tokens, seed
        self.temperature, self.top_p = temperature, top_p
        self.done = threading.Event()
        self.result = self.error = None


class Server:
    """Model + batching worker + HTTP front end. `start()` returns once it listens; `port` is the bound port."""

    def __init__(self, cfg: ServeConfig):
        from hstap.data.decode import EmbeddedEngine

        self.cfg = cfg
        self.engine = EmbeddedEngine(cfg.target, cfg.device, cfg.dtype)
        self.name = cfg.model_name or Path(cfg.target).resolve().name
        self.jobs: queue.Queue[_Job] = queue.Queue()
        self.lock = threading.Lock()
        self.counts = {"requests": 0, "completed": 0, "injected_failures": 0, "batches": 0}
        self.fail_left = int(os.environ.get("HSTAP_SERVE_FAIL_FIRST", "0") or 0)
        self.httpd = ThreadingHTTPServer((cfg.host, cfg.port), _make_handler(self))
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]

    def start(self) -> None:
        threading.Thread(target=self._worker, name="hstap-serve-model", daemon=True).start()
        threading.Thread(target=self.httpd.serve_forever, name="hstap-serve-http", daemon=True).start()

    def shutdown(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _worker(self) -> None:
        while True:
            batch = [self.jobs.get()]
            while len(batch) < self.cfg.batch_size:  # take whatever else is already waiting, never wait for more
                try:
                    batch.append(self.jobs.get_nowait())
                except queue.Empty:
                    break
            try:
                res = self.engine.complete([j.prompt for j in batch], [j.max_tokens for j in batch],
                                           [j.temperature for j in batch], [j.top_p for j in batch],
                                           [j.seed for j in batch])
                for j, r in zip(batch, res):
                    j.result = r
            except Exception as e:  # noqa: BLE001 - reported to each waiting client as a 500, the worker lives on
                for j in batch:
                    j.error = f"{type(e).__name__}: {e}"
            with self.lock:
                self.counts["batches"] += 1
            for j in batch:
                j.done.set()

    def inject_failure(self) -> bool:
        with self.lock:
            self.counts["requests"] += 1
            if self.fail_left > 0:
                self.fail_left -= 1
                self.counts["injected_failures"] += 1
                return True
        return False

    def chat(self, body: dict) -> dict:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise _BadRequest("messages: a non-empty list is required")
        clean = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") \
                    or not isinstance(m.get("content"), str):
                raise _BadRequest(f"messages[{i}]: needs role system|user|assistant and string content")
            clean.append({"role": m["role"], "content": m["content"]})
            if isinstance(m.get("reasoning_content"), str) and m["role"] == "assistant":
                clean[-1]["reasoning_content"] = m["reasoning_content"]
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise _BadRequest("chat_template_kwargs: a JSON object is required")
        if body.get("stream"):
            raise _BadRequest("stream: not supported by hstap serve")
        if body.get("n", 1) != 1:
            raise _BadRequest("n: only 1 is supported")
        try:
            max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or self.cfg.max_new_tokens)
            temperature = 1.0 if body.get("temperature") is None else float(body["temperature"])  # OpenAI default
            top_p = 1.0 if body.get("top_p") is None else float(body["top_p"])
            seed = int(body["seed"]) if body.get("seed") is not None else random.randrange(1 << 31)
        except (TypeError, ValueError) as e:
            raise _BadRequest(f"bad sampling parameter: {e}") from None
        if max_tokens < 1 or temperature < 0 or not 0 < top_p <= 1:
            raise _BadRequest("need max_tokens >= 1, temperature >= 0, 0 < top_p <= 1")
        try:
            prompt = self.engine.render(clean, kwargs)
        except HstapError as e:
            raise _BadRequest(str(e)) from None
        if self.engine.max_len and len(prompt) >= self.engine.max_len:
            raise _BadRequest(f"prompt of {len(prompt)} tokens fills the model's context ({self.engine.max_len})")
        job = _Job(prompt, min(max_tokens, self.cfg.max_new_tokens), temperature, top_p, seed)
        self.jobs.put(job)
        job.done.wait()
        if job.error is not None:
            raise RuntimeError(job.error)
        _, toks, finish = job.result
        with self.lock:
            self.counts["completed"] += 1
        message = self.engine.message(prompt, toks, finish)
        message.pop("finish_reason")
        return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
                "model": self.name,
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(toks),
                          "total_tokens": len(prompt) + len(toks)}}


def _make_handler(srv: Server):
    class Handler(BaseHTTPRequestHandler):
        server_version = "hstap-serve"

        def log_message(self, fmt, *args):  # one line per request would drown the caller's output
            pass

        def _send(self, code: int, obj: dict, headers: dict | None = None) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def _error(self, code: int, msg: str, headers: dict | None = None) -> None:
            kind = "invalid_request_error" if code < 500 else "server_error"
            self._send(code, {"error": {"message": msg, "type": kind, "code": code}}, headers)

        def do_GET(self):
            path = self.path.split("?")[0].rstrip("/")
            if path == "/health":
                with srv.lock:
                    self._send(200, {"status": "ok", "model": srv.name, "fail_left": srv.fail_left, **srv.counts})
            elif path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": srv.name, "object": "model", "owned_by": "hstap"}]})
            else:
                self._error(404, f"no route {self.path}")

        def do_POST(self):
            if self.path.split("?")[0].rstrip("/") != "/v1/chat/completions":
                return self._error(404, f"no route {self.path}")
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                if not isinstance(body, dict):
                    raise ValueError("not an object")
            except ValueError as e:
                return self._error(400, f"body is not a JSON object: {e}")
            if srv.inject_failure():
                return self._error(503, "injected failure (HSTAP_SERVE_FAIL_FIRST)", {"Retry-After": "0"})
            try:
                self._send(200, srv.chat(body))
            except _BadRequest as e:
                self._error(400, str(e))
            except Exception as e:  # noqa: BLE001 - any engine failure is the server's, not the client's
                self._error(500, f"{type(e).__name__}: {e}")

    return Handler


def serve(cfg: ServeConfig) -> None:
    """`hstap serve`: load the target, answer on cfg.host:cfg.port until interrupted (Ctrl-C, SIGINT)."""
    srv = Server(cfg)
    srv.start()
    print(f"hstap serve: {srv.name} on http://{cfg.host}:{srv.port}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        srv.shutdown()
