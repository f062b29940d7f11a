"""The bounded queue between the thread that produces captured states (the embedded engine's forward, an SGLang
scheduler's hook, vLLM's connector) and the one writer thread that stores them, with its two policies:

- back-pressure (`put(item)`): while `size` items wait for storage the producer waits too, for as long as the writer
  thread lives. What must not be lost waits: a capture run's batches, a driver's requests.
- never wait (`put(item, wait=False)`): a full queue refuses the item at once, so serving never waits for a tap; the
  caller drops it (counted) or keeps it for the writer to take when idle.

`close()` hands the writer its end (None, after every queued item) and joins it. The writer thread's loop reads
`items` (the embedded engine's runner, `hstap.capture.served.drain` in a server).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable


class WriterQueue:
    """`size` items at most between a producer and the writer thread running `loop` (started by `start()`)."""

    def __init__(self, size: int, loop: Callable[[], None], name: str, poll_s: float = 1.0):
        self.items: queue.Queue = queue.Queue(maxsize=max(1, int(size)))
        self.thread: threading.Thread | None = None
        self.poll_s = poll_s  # how often a waiting producer looks at the writer (alive? failed?)
        self._loop, self._name = loop, name
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the writer thread (the first call; later ones do nothing, from any thread)."""
        if self.thread is None:
            with self._lock:
                if self.thread is None:
                    self.thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                    self.thread.start()

    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def full(self) -> bool:
        return self.items.full()

    def put(self, item, wait: bool = True, check: Callable[[], None] | None = None) -> bool:
        """Hand `item` to the writer thread. wait=True (back-pressure): blocks while the queue is full; False when the
        writer thread stopped meanwhile (the item is not queued); `check()` runs at each poll while waiting (to raise
        the writer's error, say). wait=False: never blocks; False when the queue is full."""
        if not wait:
            try:
                self.items.put_nowait(item)
                return True
            except queue.Full:
                return False
        while True:
            try:
                self.items.put(item, timeout=self.poll_s)
                return True
            except queue.Full:
                if check is not None:
                    check()
                if not self.alive():
                    return False

    def close(self, timeout: float | None = None) -> bool:
        """Hand the writer thread its end and wait up to `timeout` s (None: as long as it takes) for it to store what
        was queued and stop; False when the queue stayed full for `timeout` s (a writer that cannot drain)."""
        if not self.alive():
            return True
        try:
            self.items.put(None, timeout=timeout)
        except queue.Full:
            return False
        self.thread.join(timeout)
        return True
