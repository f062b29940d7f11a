"""Whether a prepared set fits a target: made with the target's tokenizer, rendered with its chat template.

A prepared set's meta.json records the hashes of what made it (`tokenizer_sha256`, `chat_template_sha256`, computed as
`hstap.artifacts.model_dir` computes them), and a target's fingerprint (`hstap.artifacts.model_dir.target_fingerprint`, the block a store
header records) the same hashes of the target directory. Every stage that runs a target over a prepared set checks
them before it spends any time: capture (`hstap.capture.inputs.resolve`), train and eval
(`hstap.speculative.inputs`). The chat-template kwargs (a reasoning model's `enable_thinking`) a prepared set records
must equal those `hstap generate` made its answers with (`check_template_kwargs`, run by prepare).

    from hstap.data.fits import check_tokenizer
    check_tokenizer(PREPARED, read_meta(PREPARED), target_fingerprint(TARGET))
"""

from __future__ import annotations

from pathlib import Path

from hstap.common import HstapError


def check_tokenizer(data: str, meta: dict, target_block: dict, max_token_id=None) -> None:
    """Refuse prepared data tokenized by another tokenizer than the target's.

    With a tokenizer in the target directory the two tokenizer_sha256 must match; without one, the prepared vocabulary
    must fit the target's embedding (vocab_size, and `max_token_id()` when given, a callable: it scans the data)."""
    want, got = target_block.get("tokenizer_sha256"), meta.get("tokenizer_sha256")
    meta_path = Path(data) / "meta.json"
    if want is not None:
        if got != want:
            raise HstapError(f"{meta_path}:1: tokenizer_sha256: the data was prepared with the tokenizer of "
                             f"{meta.get('tokenizer')!r} ({str(got)[:12]}), not the target's ({want[:12]}, "
                             f"{target_block['path']}); re-run hstap prepare --tokenizer {target_block['path']}")
        return
    V = int(target_block["vocab_size"])
    if int(meta.get("vocab_size", 0)) > V:
        raise HstapError(f"{meta_path}:1: vocab_size: the data's tokenizer has {meta.get('vocab_size')} tokens, "
                         f"more than the target's {V} embedding rows (prepared with another tokenizer?)")
    if max_token_id is not None:
        mx = max_token_id()
        if mx is not None and mx >= V:
            raise HstapError(f"{data}: token id {mx} is out of the target's vocabulary (0..{V - 1}); "
                             "prepared with another tokenizer?")


def check_template(data: str, meta: dict, target_block: dict, allow: bool = False) -> None:
    """Refuse prepared data rendered with another chat template than the target's, unless `allow`
    (--allow-template-mismatch): both hashes known and different, or data rendered with a template for a target whose
    tokenizer has none (a base model: an engine serving it chats with whatever template it is given, so say which).
    Data without a template hash, or a target without a tokenizer, passes."""
    want, got = target_block.get("chat_template_sha256"), meta.get("chat_template_sha256")
    if got is None or want == got or allow:
        return
    where = f"{Path(data) / 'meta.json'}:1: chat_template_sha256"
    if want is None:
        if target_block.get("tokenizer_sha256") is None:
            return  # no tokenizer in the target directory: nothing to compare with
        raise HstapError(f"{where}: the data was rendered with chat template {got[:12]} ({meta.get('chat_template')}), "
                         f"and the target's tokenizer has none ({target_block['path']}); if the engine will serve it "
                         f"with that template, pass --allow-template-mismatch")
    raise HstapError(f"{where}: the data was rendered with chat template {got[:12]} ({meta.get('chat_template')}), the "
                     f"target's is {want[:12]} ({target_block['path']}); re-run hstap prepare without --chat-template, "
                     f"or pass --allow-template-mismatch")


def check_template_kwargs(what: str, recorded: dict | None, used: dict, flag: str = "--chat-template-kwargs",
                          allow: bool = False) -> None:
    """Refuse rendering with other chat-template kwargs than `what` was made with (`recorded`; None: not recorded,
    passes), unless `allow`: a reasoning model with `enable_thinking` on for one and off for the other renders other
    prompts and other answers than the server runs."""
    import json

    if recorded is None or dict(recorded) == dict(used) or allow:
        return
    made = json.dumps(recorded, sort_keys=True) if recorded else "none"
    now = json.dumps(used, sort_keys=True) if used else "none"
    fix = f"pass {flag} '{made}', as the server runs" if recorded else f"drop {flag}"
    raise HstapError(f"{what}: chat_template_kwargs: made with {made}, this run renders with {now}; {fix}")
