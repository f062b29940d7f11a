"""The serve loop's gate without a server: the held-back samples it keeps from a store whose shards come and go, its
score of a drafter against chain decoding itself, and the reload check's rule."""

from __future__ import annotations

import pytest
from helpers.train import build_assets, states_store


def test_held_back_keeps_the_newest_held_back_samples_and_survives_consumed_shards(tiny_tokenizer, tmp_path):
    from hstap.serve_loop.gate import HeldBack
    from hstap.store.manifest import load_manifest
    from hstap.train.data import is_eval

    assets = build_assets(tmp_path / "a", tiny_tokenizer[0], n=4, with_store=False)
    names = [f"s{i:03d}" for i in range(60)]
    store = tmp_path / "store"
    states_store(store, assets["target"], names, seed=1)  # one sample a shard
    held = [n for n in names if is_eval(n, 0.3)]
    assert 5 < len(held) < 40

    every = HeldBack(store, 0.3, keep=100)
    every.refresh()
    assert every.ids() == held and every.missed == 0
    newest = HeldBack(store, 0.3, keep=4)
    newest.refresh()
    assert newest.ids() == held[-4:]
    x = newest.samples[-1]
    assert x["aux"].shape[1:] == (3, 64) and x["final"].shape[0] == x["input_ids"].shape[0]

    gone = {e["ids"][0]: e["file"] for e in load_manifest(store)["shards"]}
    (store / gone[held[0]]).unlink()  # consumed by the trainer before the gate read it
    late = HeldBack(store, 0.3, keep=100)
    late.refresh()
    assert late.ids() == held[1:] and late.missed == 1
    late.refresh()  # shards already seen are not read again
    assert late.ids() == held[1:]


def test_the_gate_score_is_chain_decoding_on_the_targets_own_answers(vllm_llama, greedy_drafted):
    """On the target's own greedy answers the gate's sim tau is what chain decoding with that drafter yields (tokens
    per target forward), and a drafter with zeroed weights scores 1.0 (nothing accepted)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from hstap.artifacts.drafter_dir import resolve_drafter_dir
    from hstap.artifacts.model_dir import load_target, target_head
    from hstap.serve_loop.gate import score_drafter
    from hstap.speculative.drivers import speculative_generate
    from hstap.data.prompts import prompt_from_mask
    from hstap.speculative.evaluate import eos_ids, load_any_drafter
    from hstap.store.reader import open_store

    greedy, run, root = greedy_drafted
    store = open_store(root / "store")
    samples = [store[i] for i in range(len(store))]
    embed, head = target_head(str(vllm_llama))
    k = 3
    got = score_drafter(resolve_drafter_dir(run), samples, store.layers, embed, head, k)

    target, tok = load_target(str(vllm_llama), device="cpu", dtype="fp32")
    drafter, _ = load_any_drafter(str(run), target)
    forwards = produced = 0
    for s in samples:
        ids, lm = s["input_ids"].tolist(), s["loss_mask"].tolist()
        p = prompt_from_mask(ids, lm)
        answer = ids[len(p):]
        out, st = speculative_generate(target, drafter, p, len(answer), mode="chain", k=k, eos_ids=eos_ids(tok, target))
        assert out == answer
        forwards, produced = forwards + st["verify_forwards"], produced + st["verify_tokens"]
    assert got["samples"] == len(samples) and produced / forwards > 1.5  # the drafter is accepted: a real comparison
    # replayed rounds equal decoding's but for a rare argmax flip between the two float paths (test_drivers.py)
    assert got["sim_tau"] == pytest.approx(produced / forwards, rel=0.03)

    zero = root / "zeroed"
    shutil.copytree(resolve_drafter_dir(run), zero, dirs_exist_ok=True)
    w = load_file(str(zero / "drafter.safetensors"))
    save_file({n: torch.zeros_like(v) if v.is_floating_point() else v for n, v in w.items()},
              str(zero / "drafter.safetensors"))
    bad = score_drafter(zero, samples, store.layers, embed, head, k)
    assert bad["sim_tau"] < got["sim_tau"] and bad["sim_tau"] < 1.2


def test_reload_check_fails_a_load_that_drafts_worse_or_not_at_all():
    from hstap.serve_loop.gate import reload_check

    def recs(drafted, accepted, n=4):
        return [{"num_draft_tokens": drafted, "num_accepted_draft_tokens": accepted, "num_spec_steps": 5}] * n

    assert reload_check(recs(30, 12), recs(30, 10), 0.5)["ok"]  # a little worse than before: kept
    assert not reload_check(recs(30, 12), recs(30, 2), 0.5)["ok"]  # acceptance collapsed: rolled back
    assert not reload_check(recs(30, 0), recs(0, 0), 0.5)["ok"]  # no draft proposed at all after the load
    c = reload_check(recs(30, 12), recs(30, 7), 0.5)  # 7/30 >= 0.5 * 12/30
    assert c["acceptance"] == pytest.approx(7 / 30) and c["before"] == pytest.approx(12 / 30) and c["ok"]
