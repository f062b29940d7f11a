"""What a capture driver (the `hstap capture` process) and a writer inside a serving engine (the SGLang hook, the vLLM
connector) agree on, whatever the engine:

- request ids `hstap:<session>:<row>:<sha256(id)[:16]>:<attempt>` (`encode_rid` / `decode_rid`): ASCII and short, so
  that sample ids (any string) never travel to the server and are never used in paths; the engine side checks the
  digest against row `row` of the prepared set before it stores anything;
- the events directory of an engine inside the store (`sglang-events/`, `vllm-events/`; the store's reader ignores
  it): the engine side appends one JSON line per event (a dropped request, an error) to `r<rank>-<pid>.jsonl`; the
  driver reads them (`read_events`); `driver.lock` keeps one driver per store (`lock_events`);
- the end of a session: when the driver has sent everything and seen it committed, it writes `end-<session>.json`
  (`end_session`); every engine-side writer then closes its store rank, which is the end of writing a
  `hstap train --follow` waits on (spec in hstap/store/format.py).

`Requests` is the driver's side of a session over HTTP: requests in flight, and the commits and drops reported back.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import threading
import time
import urllib.error
import urllib.request
import collections
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hstap.common import HstapError, atomic_write_json
from hstap.store.manifest import committed_ids_of, load_manifest, load_parts, writing_state

RID_PREFIX = "hstap:"
END_PREFIX = "end-"


def sample_digest(sample_id: str) -> str:
    return hashlib.sha256(str(sample_id).encode("utf-8", "surrogatepass")).hexdigest()[:16]


def encode_rid(session: str, row: int, sample_id: str, attempt: int = 0) -> str:
    return f"{RID_PREFIX}{session}:{int(row)}:{sample_digest(sample_id)}:{int(attempt)}"


def decode_rid(rid) -> tuple[str, int, str] | None:
    """(session, row, digest) of an hstap rid, None for anything else (other clients, hostile strings)."""
    if not isinstance(rid, str) or not rid.startswith(RID_PREFIX) or len(rid) > 128 or not rid.isascii():
        return None  # isascii: str.isdigit/isalnum also accept non-ASCII digits and letters
    parts = rid[len(RID_PREFIX):].split(":")
    if len(parts) != 4 or not parts[0].isalnum() or not parts[1].isdigit() or not parts[3].isdigit():
        return None
    if len(parts[2]) != 16 or any(c not in "0123456789abcdef" for c in parts[2]):
        return None
    return parts[0], int(parts[1]), parts[2]


def end_marker(session: str) -> str:
    """The name, in an events directory, of the file that ends a driver session."""
    return f"{END_PREFIX}{session}.json"


def read_events(store: str, events_dir: str) -> list[dict]:
    """Every event line in STORE/events_dir/*.jsonl (a line being written is skipped)."""
    out = []
    d = Path(store) / events_dir
    if d.is_dir():
        for f in sorted(d.glob("*.jsonl")):
            for line in f.read_text(errors="replace").splitlines():
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
    return out


def lock_events(out: str, events_dir: str, new: bool, keep: str | None = None):
    """Create STORE/events_dir (its events and end markers removed with --new, files matching `keep` left) and take its
    driver lock: one driver per store at a time. Returns the open lock file (closing it releases the lock)."""
    d = Path(out) / events_dir
    if new and d.exists():
        for f in d.iterdir():
            if keep is None or not f.match(keep):
                shutil.rmtree(f) if f.is_dir() else f.unlink()
    d.mkdir(parents=True, exist_ok=True)
    return exclusive_lock(d / "driver.lock", f"{out}: another hstap capture is driving a server into this store")


def exclusive_lock(path: Path, busy: str):
    """An open file holding an exclusive flock on `path` (closing it releases the lock); HstapError(busy) when another
    process holds it."""
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise HstapError(busy) from None
    return f


def end_session(out: str, events_dir: str, session: str, poll_s: float, timeout_s: float) -> bool:
    """Tell the engine side that this session wrote everything (`end_marker`) and wait until every store rank is
    closed (the end of writing a `hstap train --follow` waits on). Returns whether they all closed within `timeout_s`."""
    atomic_write_json(Path(out) / events_dir / end_marker(session), {"session": session, "t": time.time()})
    deadline = time.monotonic() + timeout_s
    while True:
        ranks, finished = writing_state(load_manifest(Path(out)), load_parts(Path(out)))
        if len(finished) == ranks:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)


def http_json(url: str, body: dict | None = None, timeout: float = 30.0) -> dict:
    """GET (body None) or POST a JSON body; the decoded JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"{}")


class RequestError(Exception):
    """A request the server answered wrongly (an HTTP error, a short prefill): the run stops, no retry."""


class Requests:
    """The requests of one session, `concurrency` in flight, and what the engine side reports back: `pending` (sample
    ids sent or to send and not committed yet), `dropped` (id -> reason) and `errors` (the run stops at the first).

    `request(row, input_ids, attempt)` sends one (raising RequestError for a wrong answer; URLError / OSError are
    retried twice); `ids` are the prepared set's sample ids by row; `who` names the engine side in error messages."""

    def __init__(self, store: str, events_dir: str, session: str, ids: list[str], t_wall0: float, concurrency: int,
                 poll_s: float, request: Callable[[int, list[int], int], None], who: str = "server side"):
        self.store, self.events_dir, self.session, self.ids, self.t_wall0 = store, events_dir, session, ids, t_wall0
        self.who = who  # names the engine side in error messages
        self.concurrency, self.poll_s, self.request = concurrency, poll_s, request
        self.errors: list[str] = []
        self.pending: set[str] = set()
        self.dropped: dict[str, str] = {}
        self.last_progress = time.monotonic()
        self.sem = threading.BoundedSemaphore(concurrency)

    def send_all(self, todo: list[int], input_ids) -> None:
        """Send rows `todo` (`input_ids(row)` gives a row's tokens), polling the store while requests are in flight."""
        self.pending = {self.ids[i] for i in todo}
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            next_poll = time.monotonic() + self.poll_s
            for i in todo:
                while not self.sem.acquire(timeout=self.poll_s):
                    self.poll()
                if self.errors:
                    self.sem.release()
                    break
                pool.submit(self.send, i, input_ids(i))
                if time.monotonic() > next_poll:
                    self.poll()
                    next_poll = time.monotonic() + self.poll_s

    def wait_for_commits(self, commit_timeout_s: float) -> None:
        """Poll until every pending sample is committed or dropped, an error came, or nothing moved for the timeout."""
        self.last_progress = time.monotonic()
        while self.pending and not self.errors and time.monotonic() - self.last_progress < commit_timeout_s:
            self.poll()
            if self.pending:
                time.sleep(self.poll_s)

    def send(self, row: int, input_ids: list[int]) -> None:
        from hstap.capture.inputs import short_id

        sid = self.ids[row]
        try:
            for attempt in range(3):
                try:
                    self.request(row, input_ids, attempt)
                    return
                except RequestError as e:
                    self.errors.append(f"sample {short_id(sid)}: {e}")
                    return
                except urllib.error.HTTPError as e:
                    self.errors.append(f"sample {short_id(sid)}: HTTP {e.code}: {e.read()[:300]!r}")
                    return
                except (urllib.error.URLError, OSError) as e:
                    if attempt == 2:
                        self.errors.append(f"sample {short_id(sid)}: {e}")
                    time.sleep(1.0 + 2 * attempt)
        finally:
            self.sem.release()

    def check(self, where: str, commit_timeout_s: float, writer: str) -> None:
        """HstapError for the first error of the session, or for samples answered but never committed by `writer`
        (the engine side, named in the message) within the timeout."""
        if self.errors:
            more = f" (and {len(self.errors) - 1} more)" if len(self.errors) > 1 else ""
            raise HstapError(f"{where}: {self.errors[0]}{more}")
        if self.pending:
            from hstap.capture.inputs import short_id

            raise HstapError(f"{self.store}: {len(self.pending)} sample(s) were answered by the server but never "
                             f"committed by {writer} within {commit_timeout_s:.0f} s (e.g. "
                             f"{short_id(sorted(self.pending)[0])}); is it writing to this directory? re-run to resume")

    def reasons(self) -> dict[str, int]:
        """The dropped samples by reason (the word before the first colon of each drop)."""
        return dict(collections.Counter(v.split(":")[0] for v in self.dropped.values()))

    def print_drops(self, closed: bool, unclosed: str) -> None:
        """The run's first five drops, and `unclosed` when the engine side did not close its store rank(s)."""
        from hstap.capture.inputs import short_id

        for sid, why in list(self.dropped.items())[:5]:
            print(f"capture: dropped {short_id(sid)}: {why}")
        if not closed:
            print(f"capture: {unclosed}")

    def poll(self) -> None:
        """Read this session's events (drops, engine-side errors) and the samples committed so far."""
        for e in read_events(self.store, self.events_dir):
            if e.get("session") not in (self.session, None) or float(e.get("t", 0)) < self.t_wall0:
                continue
            if e.get("event") == "dropped" and e.get("id") in self.pending:
                self.dropped[e["id"]] = f"{e.get('reason')}: {e.get('detail')}"
                self.pending.discard(e["id"])
            elif e.get("event") == "error":
                msg = f"{self.who}: {e.get('kind')}: {e.get('message')}"
                if msg not in self.errors:
                    self.errors.append(msg)
        done = self.pending & committed_ids_of(self.store)  # consumed shards too: their samples were committed
        if done:
            self.pending.difference_update(done)
            self.last_progress = time.monotonic()
