"""The real chat model's shared assets (fixtures in conftest.py): SmolLM2-135M-Instruct answers two MT-bench questions,
both turns, the second after its own first answer (`hstap data --source mtbench --turn 2`, then `hstap generate
--capture`), prepared, and captured by the hf engine. test_real_chat.py and test_real_vllm.py share them."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

NEW = 8  # new tokens per answer: MT-bench answers run to hundreds of tokens, so every answer here is cut


def quiet(fn, *a, **kw):
    with contextlib.redirect_stdout(io.StringIO()):
        return fn(*a, **kw)


def answer_mtbench(target: Path, root: Path) -> tuple[Path, dict]:
    """(root, generate's summary): ROOT/answers.jsonl (both turns open, answered), ROOT/tap (fp32 store of the last
    turns, from generate --capture)."""
    from hstap.capture.tap import generate
    from hstap.data.generate_config import GenerateConfig
    from hstap.data.sources import DataConfig, data

    quiet(data, DataConfig(source="mtbench", turn=2, out=str(root / "t2.open.jsonl"), max_samples=2))
    recs = [json.loads(line) for line in (root / "t2.open.jsonl").read_text().splitlines()]
    for r in recs:  # MT-bench's answer generation: turn 2 answered too, after the model's own turn 1
        r["messages"].append({"role": "assistant", "content": None})
    (root / "both.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    summary = quiet(generate, GenerateConfig(data=[str(root / "both.jsonl")], out=str(root / "answers.jsonl"),
                                             target=str(target), max_new_tokens=NEW, batch_size=2,
                                             capture=str(root / "tap"), capture_dtype="fp32"))
    return root, summary


def prepare_answers(target: Path, root: Path):
    """(ROOT/prepared, prepare's summary, the loaded set)."""
    from hstap.data.prepare_config import PrepareConfig
    from hstap.data.prepare import load_prepared, prepare

    s = quiet(prepare, PrepareConfig(tokenizer=str(target), data=[str(root / "answers.jsonl")],
                                     out=str(root / "prepared"), draft_vocab=1000))
    return root / "prepared", s, load_prepared(root / "prepared")


def capture_hf(target: Path, prepared: Path) -> Path:
    """`hstap capture --engine hf --dtype fp32` of PREPARED (default layers) into a sibling `store`."""
    from hstap.capture.config import CaptureConfig
    from hstap.capture.stage import capture

    out = prepared.parent / "store"
    quiet(capture, CaptureConfig(target=str(target), data=str(prepared), out=str(out), dtype="fp32", device="cpu"))
    return out
