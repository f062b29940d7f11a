"""What each stage reads and writes, by the fields of its config that name paths: checked by the command line
(`hstap.cli.main`) after the config is parsed and before the stage's module loads (torch and transformers take
seconds), so that a mistyped input or an output that cannot be written is one line at once. The stages check what
they read and what they may replace themselves (`hstap.artifacts.outputs`).
"""

from __future__ import annotations

import os
from typing import Any

from hstap.common import HstapError

# Fields that name inputs which must exist before the stage starts: checked before the stage's module (torch,
# transformers: seconds) is imported, so that a mistyped path is one line at once. The stages check them again.
INPUT_PATHS: dict[str, tuple[str, ...]] = {
    "prepare": ("tokenizer", "data", "chat_template"),
    "generate": ("target", "data"),
    "capture": ("target", "data", "src"),
    "train": ("target", "store", "data", "vocab_map", "eval_store", "init_from"),
    "export": ("run", "store", "target"),
    "eval": ("target", "data", "drafter"),
    "serve-loop": ("target", "prompts", "drafter", "reference", "vocab_map"),
    "verify": ("store", "target", "a", "b"),
    "demo": ("target", "data"),
}


def check_input_paths(stage: str, cfg: Any) -> None:
    """HstapError naming the first input path of `cfg` (INPUT_PATHS) that does not exist, or that is neither a regular
    file nor a directory (a FIFO would be read once, and hangs or reads empty where an input is read twice)."""
    from hstap.config import lookup

    for name in INPUT_PATHS.get(stage, ()):
        if stage == "train" and name == "store" and getattr(cfg, "follow", False):
            continue  # --follow: the store may be created by a capture that starts later
        v = lookup(cfg, name)
        for p in v if isinstance(v, list) else [v]:
            if p and not os.path.exists(p):
                raise HstapError(f"{p}: --{name.replace('_', '-')}: does not exist")
            if p and not (os.path.isfile(p) or os.path.isdir(p)):
                raise HstapError(f"{p}: --{name.replace('_', '-')}: is not a regular file (a FIFO, a socket or a "
                                 f"device); give a file")


# Fields that name outputs, and what is written there: checked before the stage's module loads, so that an output
# that cannot be written (under a file, in a read-only directory, a FIFO) is one line before any work
# (`hstap.artifacts.outputs.check_writable`), not a traceback after minutes of it. The stages decide what they replace.
OUTPUT_PATHS: dict[str, tuple[tuple[str, str], ...]] = {
    "data": (("out", "file"),),
    "convert": (("out", "dir"),),
    "prepare": (("out", "dir"),),
    "generate": (("out", "file"), ("capture", "dir")),
    "capture": (("out", "dir"),),
    "train": (("out", "dir"),),
    "export": (("out", "dir"),),
    "eval": (("out", "dir"),),
    "serve-loop": (("out", "dir"),),
    "verify": (("report", "file"),),
    "demo": (("out", "dir"),),
}


def check_output_paths(stage: str, cfg: Any) -> None:
    """HstapError naming the first output path of `cfg` (OUTPUT_PATHS) that cannot be written."""
    from hstap.artifacts.outputs import check_writable
    from hstap.config import lookup

    for name, kind in OUTPUT_PATHS.get(stage, ()):
        v = lookup(cfg, name)
        if v:
            check_writable(v, "--" + name.replace("_", "-"), kind)
