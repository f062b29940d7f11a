"""What the stages print for people: aligned tables of figures with units, and progress over a known number of items.

Machine-readable results go to files (report.json, metrics.jsonl, demo.json); the console gets these instead of raw
dicts. Floats are formatted by the caller (with units), never printed as repr.
"""

from __future__ import annotations

import sys


def table(headers: list[str] | None, rows: list[list[str]], indent: str = "  ") -> str:
    """Rows of strings as left-aligned columns (the last column unpadded); headers (optional) above a rule."""
    cells = ([headers] if headers else []) + [[str(c) for c in r] for r in rows]
    n = max(len(r) for r in cells)
    widths = [max(len(r[i]) for r in cells if i < len(r)) for i in range(n)]

    def line(r: list[str]) -> str:
        return indent + "  ".join(c.ljust(widths[i]) if i < len(r) - 1 else c for i, c in enumerate(r)).rstrip()

    out = [line(r) for r in cells]
    if headers:
        out.insert(1, indent + "  ".join("-" * w for w in widths))
    return "\n".join(out)


def num(x: float, digits: int = 0) -> str:
    """A number with thousands separators: num(12345.6) = '12,346', num(3.14159, 2) = '3.14'."""
    return f"{x:,.{digits}f}"


class Progress:
    """Progress over `total` items on stderr: a tqdm bar on a terminal, else a line at each tenth (a log file gets
    at most ten lines, whatever the total). `update(n, note)` adds n items done; `note` is shown beside the count."""

    def __init__(self, desc: str, total: int, unit: str):
        self.desc, self.total, self.unit, self.done, self._tenth = desc, total, unit, 0, 0
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=desc, unit=f" {unit}", file=sys.stderr, dynamic_ncols=True, leave=False)

    def update(self, n: int = 1, note: str = "") -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            self.bar.set_postfix_str(note, refresh=False)
            return
        tenth = 10 * self.done // max(1, self.total)
        if tenth > self._tenth:
            self._tenth = tenth
            print(f"{self.desc}: {self.done}/{self.total} {self.unit}" + (f", {note}" if note else ""),
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
