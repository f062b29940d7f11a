"""Training on side branches (hstap/train/side.py): a branch becomes the sequence the target saw (accepted prefix, then
the rejected drafts), only the rejected rows' distributions are targets, and TTT over it equals, loss and gradient,
a reference decoded position by position on that sequence with the whole prefix in view."""

from __future__ import annotations

import torch
from helpers.drafter import tiny_setup

from hstap.batching import collate
from hstap.train.side import SideCollate, branch_samples, branches
from hstap.train.ttt import TTTModel, plan_rows, target_distribution


def _sample_with_branches(seed=3):
    """Row 0 of tiny_setup as a sample (T=10) with two branches: 2 rows at positions 5, 6 (a verify step that accepted
    1 draft) and 1 row at 8; their tokens, states random."""
    d, W, hot, t2d, ids, lm, L, aux, final = tiny_setup(seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    side = {"input_ids": torch.tensor([hot[0], 7, hot[2]]), "pos": torch.tensor([5, 6, 8]),
            "parent": torch.tensor([4, -1, 7]), "step": torch.tensor([2, 2, 4]), "accepted": torch.tensor([1, 1, 0]),
            "aux": torch.randn(3, aux.shape[2], aux.shape[3], generator=g), "final": torch.randn(3, final.shape[2],
                                                                                             generator=g)}
    x = {"id": "s", "input_ids": ids[0], "loss_mask": lm[0], "aux": aux[0], "final": final[0], "side": side}
    return d, W, hot, t2d, x


def test_a_branch_is_the_sequence_the_target_saw():
    _, _, _, _, x = _sample_with_branches()
    s = x["side"]
    assert branches(s) == [[0, 1], [2]]
    b0, b1 = branch_samples(x, 8, context=3)
    assert b0["input_ids"].tolist() == x["input_ids"][2:5].tolist() + s["input_ids"][:2].tolist() + [0]
    assert b0["loss_mask"].tolist() == [0, 0, 0, 0, 1, 1]  # targets: the distributions at positions 5, 6 (side rows)
    assert torch.equal(b0["final"][3:5], s["final"][:2]) and torch.equal(b0["aux"][:3], x["aux"][2:5])
    assert b1["input_ids"].tolist() == x["input_ids"][5:8].tolist() + [int(s["input_ids"][2]), 0]
    assert len(branch_samples(x, 1, 3)) == 1 and branch_samples(x, 0, 3) == []
    plain = {k: v for k, v in x.items() if k != "side"}
    assert branch_samples(plain, 8, 3) == []
    both = SideCollate(8, 3)([x])
    assert both["input_ids"].shape[0] == 3 and both["ids"] == ["s", "s#side0", "s#side1"]
    assert torch.equal(SideCollate(0, 3)([x])["input_ids"], collate([x])["input_ids"])


def _decoded_reference(d, W, hot, t2d, x, K, decay):
    """The branch objective from its definition, by decoding: for each branch, the target's view (tokens 0..pos-1 of
    the sample, then the branch's drafts; states likewise), and every (anchor t, step k) whose target row s = t+1+k is
    a side row: a fresh cache extended over the view's tokens 1..t+1 with fc(states 0..t), then steps feeding the
    view's tokens; the cross-entropy against the target's softmax at s over the draft vocabulary. Mean per step over
    the counted rows of all branches, weighted decay**k."""
    from hstap.models.drafter import new_drafter_cache

    s = x["side"]
    terms = [[] for _ in range(K)]
    for rows in branches(s):
        s0 = int(s["pos"][rows[0]])
        ids = torch.cat([x["input_ids"][:s0], s["input_ids"][rows]])  # (n,)
        aux = torch.cat([x["aux"][:s0], s["aux"][rows]])  # (n, KA, H)
        fin = torch.cat([x["final"][:s0], s["final"][rows]])  # (n, H)
        hidden = d.project(aux[None])  # (1, n, H)
        n = ids.numel()
        for t in range(n):
            for k in range(K):
                srow = t + 1 + k
                if srow < s0 or srow >= n:
                    continue
                zt = W @ fin[srow]
                if not bool(t2d[zt.argmax()]):
                    continue
                cache = new_drafter_cache(d)
                tok = [int(ids[j + 1]) for j in range(t + 1)]
                h = d(torch.tensor([tok]), hidden[:, :t + 1], torch.arange(t + 1)[None], cache)[:, -1:]
                for j in range(1, k + 1):
                    h = d(torch.tensor([[int(ids[t + 1 + j])]]), h, torch.tensor([[t + j]]), cache)
                z = d.compute_logits(h)[0, 0]  # (Vd,)
                p = torch.softmax(zt[hot], 0)
                terms[k].append(-(p * torch.log_softmax(z, 0)).sum())
    return sum(decay ** k * torch.stack(terms[k]).mean() for k in range(K) if terms[k])


def test_the_branch_objective_and_its_gradient_equal_decoding_by_hand():
    d, W, hot, t2d, x = _sample_with_branches()
    K, decay = 3, 0.8
    ref = _decoded_reference(d, W, hot, t2d, x, K, decay)
    params = [p for p in d.parameters() if p.requires_grad]
    ref_grads = torch.autograd.grad(ref, params)
    b = collate(branch_samples(x, 8, context=100))  # the whole prefix in view: the reference's attention
    T = b["input_ids"].shape[1]
    tb = target_distribution(b["final"], b["loss_mask"], b["lengths"], W, hot, t2d, chunk=4)
    denom = torch.tensor(plan_rows(tb, T, K))
    assert float(denom.sum()) > 3  # rows of several steps are counted
    out, _ = TTTModel(d, ttt=K, decay=decay, attn="sdpa", ce_chunk=3, loss="ce")(b["input_ids"], b["aux"], tb, denom)
    torch.testing.assert_close(out, ref.float(), rtol=1e-5, atol=1e-5)
    out.backward()
    for (name, p), g in zip([(n, p) for n, p in d.named_parameters() if p.requires_grad], ref_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_train_on_a_store_with_side_branches(small_run, tmp_path):
    """`hstap train` on a version-2 store: with --side-branches its batches carry the branches (more tokens per step);
    without, the same store trains as its plain copy does; eval is unchanged (side branches are never scored)."""
    import contextlib
    import io
    import json
    import shutil

    from hstap.config import from_flags
    from hstap.store.reader import open_store
    from hstap.store.writer import StoreWriter
    from hstap.train.config import TrainConfig
    from hstap.train.stage import train

    src = open_store(small_run["store"])
    header = {k: v for k, v in src.header.items() if k not in ("format", "version", "created", "created_unix")}
    w = StoreWriter(tmp_path / "side", header | {"side_branches": {"producer": "test", "rows": "all"}})
    for i in range(len(src)):
        x = src[i]
        T = x["input_ids"].numel()
        starts = [T // 4, T // 2, 3 * T // 4, T - 3]  # four branches of 2 rows: the sample's own rows, other tokens
        pos = torch.tensor([q + j for q in starts for j in (0, 1)])
        side = {"input_ids": (x["input_ids"][pos] + 1) % 100, "pos": pos,
                "parent": torch.tensor([v for i, q in enumerate(starts) for v in (q - 1, -1 - 2 * i)]),
                "step": torch.zeros(8, dtype=torch.long), "accepted": torch.zeros(8, dtype=torch.long),
                "aux": x["aux"][pos] * 1.5, "final": x["final"][pos] * 1.5}
        w.add(x["id"], x["input_ids"], x["loss_mask"], x["aux"], x["final"], side=side)
    w.close()
    shutil.copy(small_run["store"] / "vocab_map.safetensors", tmp_path / "side")
    logs = {}
    for name, store, n in (("plain", small_run["store"], 0), ("side0", tmp_path / "side", 0),
                           ("side", tmp_path / "side", 4)):
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            train(from_flags(TrainConfig, out=str(tmp_path / name), target=str(small_run["target"]),
                             store=str(store), steps=1, batch_tokens=2048, save_every=1, device="cpu", compile=False,
                             tensorboard=False, eval_store=str(store), side_branches=n, side_context=16))
        logs[name] = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    step = {k: next(r for r in v if "tokens" in r) for k, v in logs.items()}
    assert step["side0"]["loss"] == step["plain"]["loss"] and step["side0"]["tokens"] == step["plain"]["tokens"]
    assert step["side"]["tokens"] > step["plain"]["tokens"] and step["side"]["loss"] != step["plain"]["loss"]
    ev = {k: next(r for r in v if r.get("eval")) for k, v in logs.items()}
    assert ev["side0"]["eval_positions"] == ev["plain"]["eval_positions"] == ev["side"]["eval_positions"]
