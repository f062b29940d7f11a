"""A minimal OpenAI-compatible chat client (stdlib urllib) for `hstap generate --server URL`: SGLang, vLLM or
`hstap serve`.

`ChatClient` retries connection errors, HTTP 5xx and 429 (honouring Retry-After) with exponential backoff, `retries`
times at most, then raises HstapError; a request the server refuses for good (HTTP 4xx other than 429) raises
`RequestRejected`, a property of that one conversation. Thread-safe: one urllib request per call.
"""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time
import urllib.error
import urllib.request

from hstap.common import HstapError


class RequestRejected(Exception):
    """The server refused one request for good (HTTP 4xx other than 429): a property of that conversation."""


class ChatClient:
    """A minimal OpenAI-compatible client (stdlib urllib): bounded retries with exponential backoff on connection
    errors, HTTP 5xx and 429; thread-safe (one urllib request per call)."""

    def __init__(self, base_url: str, retries: int = 5, backoff: float = 1.0, timeout: float = 600.0):
        self.base = base_url.rstrip("/")
        if self.base.endswith("/v1"):
            self.base = self.base[:-3]
        self.retries, self.backoff, self.timeout = retries, backoff, timeout
        self.retried = 0  # retries done so far (all threads)
        self._lock = threading.Lock()

    def _call(self, path: str, body: dict | None = None) -> dict:
        url = self.base + path
        data = None if body is None else json.dumps(body).encode()
        for attempt in range(self.retries + 1):
            req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
            wait_s = min(self.backoff * 2 ** attempt, 60.0)
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    raw = resp.read()
                try:
                    return json.loads(raw)
                except ValueError:
                    raise HstapError(f"{url}: the server answered with something that is not JSON: {raw[:200]!r}")
            except urllib.error.HTTPError as e:
                detail = e.read()[:300].decode(errors="replace")
                if e.code != 429 and e.code < 500:
                    raise RequestRejected(f"{url}: HTTP {e.code}: {detail}") from None
                why = f"HTTP {e.code}: {detail}"
                ra = e.headers.get("Retry-After") if e.headers else None
                if ra and ra.strip().isdigit():
                    wait_s = min(max(wait_s, float(ra)), 60.0)
            except (urllib.error.URLError, http.client.HTTPException, OSError) as e:  # refused, reset, timeout, ...
                why = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
            if attempt == self.retries:
                raise HstapError(f"{url}: giving up after {self.retries + 1} attempts; last: {why}")
            with self._lock:
                self.retried += 1
            print(f"hstap generate: {url}: {why}; retry {attempt + 1}/{self.retries} in {wait_s:.1f}s", file=sys.stderr)
            time.sleep(wait_s)
        raise AssertionError("unreachable")

    def first_model(self) -> str:
        try:
            models = self._call("/v1/models").get("data") or []
        except RequestRejected as e:
            raise HstapError(f"{e}; pass --model") from None
        if not models or "id" not in models[0]:
            raise HstapError(f"{self.base}/v1/models lists no model; pass --model")
        return models[0]["id"]

    def chat(self, model: str, messages: list[dict], max_tokens: int, temperature: float, top_p: float,
             seed: int | None) -> tuple[str, str, int]:
        """-> (assistant text, finish_reason, completion tokens or 0 when the server reports no usage)."""
        msg, n = self.reply(model, messages, max_tokens, temperature, top_p, seed)
        return msg["content"], msg["finish_reason"], n

    def reply(self, model: str, messages: list[dict], max_tokens: int, temperature: float, top_p: float,
              seed: int | None, template_kwargs: dict | None = None) -> tuple[dict, int]:
        """-> (the assistant message: content, the reasoning the server's reasoning parser split off as
        `reasoning_content` (SGLang, older vLLM) or `reasoning` (newer vLLM), finish_reason; completion tokens or 0).
        An assistant message's `reasoning_content` is sent back as it came (servers hand it to the chat template,
        which decides whether to render it: hstap/data/reasoning.py); `template_kwargs` go as `chat_template_kwargs`."""
        from hstap.data.reasoning import answer_message

        sent = []
        for m in messages:  # no finish_reason: not a request field
            msg = {"role": m["role"], "content": m["content"]}
            if m.get("reasoning_content") is not None:
                msg["reasoning_content"] = m["reasoning_content"]
            sent.append(msg)
        body = {"model": model, "messages": sent, "max_tokens": max_tokens, "temperature": temperature,
                "top_p": top_p, "n": 1, "stream": False}
        if temperature > 0 and seed is not None:
            body["seed"] = seed
        if template_kwargs:
            body["chat_template_kwargs"] = template_kwargs
        r = self._call("/v1/chat/completions", body)
        try:
            choice = r["choices"][0]
            text = choice["message"].get("content") or ""
            reasoning = choice["message"].get("reasoning_content") or choice["message"].get("reasoning")
        except (KeyError, IndexError, TypeError, AttributeError):
            raise HstapError(f"{self.base}/v1/chat/completions: unexpected response: {json.dumps(r)[:300]}") from None
        usage = r.get("usage") or {}
        reasoning = reasoning if isinstance(reasoning, str) and reasoning else None
        return (answer_message(reasoning, text, choice.get("finish_reason") or "stop"),
                int(usage.get("completion_tokens") or 0))
