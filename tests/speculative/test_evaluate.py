"""`hstap eval` end to end on a tiny real target: prompts from JSONL and from a prepared set, report files, losslessness
check (and its failure), simulated tau from a training run's metrics.jsonl, config validation."""

from __future__ import annotations

import json

import pytest

from hstap.common import HstapError
from hstap.artifacts.drafter_dir import save_drafter
from hstap.speculative.drivers import target_generate
from hstap.config import from_flags
from hstap.speculative.config import EvalConfig
from hstap.data.prompts import prompt_from_mask
from hstap.speculative.evaluate import evaluate, read_sim_tau, sim_chain_tau
from helpers.speculate import load_tiny_target, random_drafter

CONVERSATIONS = [
    {"id": "a", "messages": [{"role": "user", "content": "def parse(s):"}]},
    {"id": "b", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "json.dumps"},
                             {"role": "assistant", "content": "It encodes."}, {"role": "user", "content": "And loads?"},
                             {"role": "assistant", "content": "It decodes."}]},
    {"id": "c", "messages": [{"role": "system", "content": "no user turn here"}]},
]


@pytest.fixture(scope="module")
def setup(tiny_llama, tmp_path_factory):
    """The target, its tokenizer, a JSONL of conversations and a training-run-shaped drafter directory."""
    root = tmp_path_factory.mktemp("eval")
    target, tok = load_tiny_target(tiny_llama)
    jsonl = root / "convs.jsonl"
    jsonl.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    run = root / "run"
    save_drafter(run / "best", random_drafter(target, (1, 2, 3), draft_vocab=300))
    (run / "best" / "trainer_state.json").write_text(json.dumps({"step": 20}))  # best = step 20, not the last eval
    (run / "metrics.jsonl").write_text(
        json.dumps({"step": 10, "loss": 3.0}) + "\n" + json.dumps({"step": 10, "eval": True, "sim_tau": 0.25}) + "\n"
        + json.dumps({"step": 20, "eval": True, "sim_tau": 0.52, "acc_cond": [0.4, 0.2, 0.5]}) + "\n"
        + json.dumps({"step": 30, "eval": True, "sim_tau": 0.375}) + "\n"
        + json.dumps({"step": 30, "loss": 2.0}) + "\n" + '{"step": 40, "ev')  # torn last line of a killed run
    return target, tok, jsonl, run, root


def test_eval_jsonl_chain_with_ngram(setup, tiny_llama, capsys):
    from hstap.data.chat import render_prompt

    target, tok, jsonl, run, root = setup
    out = root / "report-chain"
    summary = evaluate(from_flags(EvalConfig, target=str(tiny_llama), drafter=str(run), data=str(jsonl), out=str(out),
                                  k=3, max_new_tokens=12, baseline="ngram", device="cpu"))
    printed = capsys.readouterr()
    assert not [x for x in printed.out.splitlines() if x.lstrip().startswith("{")]  # a table, never a raw dict
    assert "method  tau" in printed.out and "speedup not representative" in printed.out
    for name in ("target", "ngram", "eagle"):  # progress per method: prompts done / total, tokens/s
        assert f"hstap eval: {name}: 2/2 prompts, " in printed.err
    assert (out / "acceptance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rep = json.loads((out / "report.json").read_text())
    assert summary["lossless"] is True and rep["lossless"] is True and rep["mismatches"] == []
    assert set(rep["methods"]) == {"target", "ngram", "eagle"} and rep["method"] == "eagle"
    # chain k=3 from the best checkpoint's eval line (step 20): 1 + 0.4 + 0.4*0.2 + 0.4*0.2*0.5
    assert rep["simulated_tau"] == pytest.approx(1.52) and rep["simulated"]["step"] == 20
    assert len(rep["per_position_acceptance"]) == 3 and rep["tau"] >= 1.0 and rep["speedup"] > 0
    assert rep["methods"]["target"]["speedup"] == 1.0 and rep["methods"]["eagle"]["draft_s"] > 0
    # "c" has no user turn; "b" is cut at its last user turn (trailing assistant answer dropped).
    assert [p["id"] for p in rep["prompts"]] == ["a", "b"]
    b = CONVERSATIONS[1]["messages"]
    assert rep["prompts"][1]["prompt_ids"] == render_prompt(tok, b[:4])
    eos = rep["eos_ids"]
    assert tok.convert_tokens_to_ids("<|end|>") in eos
    for p in rep["prompts"]:  # outputs are generated ids only, equal to plain decoding run here independently
        assert p["output_ids"] == target_generate(target, p["prompt_ids"], 12, eos_ids=eos)[0]
    assert rep["drafter"]["aux_layers"] == [1, 2, 3]
    assert json.loads((out / "config.json").read_text())["stage"] == "eval"
    md = (out / "report.md").read_text()
    assert "| eagle |" in md and "| ngram |" in md and "simulated tau" in md
    assert "tau = tokens per target forward" in md and "speedup = generated tokens/s" in md
    assert "not representative" in md and "measured on a CPU" in md and "the target is tiny" in md
    assert rep["speedup_notes"] and rep["plot"] == "acceptance.png" and "![per-position acceptance]" in md


def test_eval_prepared_tree_sampled(setup, tiny_llama):
    from hstap.data.prepare_config import PrepareConfig
    from hstap.data.prepare import load_prepared, prepare

    target, tok, jsonl, run, root = setup
    prepared = root / "prepared"
    prepare(PrepareConfig(tokenizer=str(tiny_llama), data=[str(jsonl)], out=str(prepared), draft_vocab=300))
    rows = {r["id"]: r for r in load_prepared(prepared)}
    out = root / "report-tree"
    evaluate(from_flags(EvalConfig, target=str(tiny_llama), drafter=str(run / "best"), data=str(prepared), out=str(out),
                        mode="tree", topk=2, depth=3, tokens=6, temperature=0.7, max_new_tokens=8, device="cpu"))
    rep = json.loads((out / "report.json").read_text())
    assert rep["lossless"] is None and rep["simulated"]["sim_tau"] == 0.52  # found from RUN/best's parent
    assert rep["simulated_tau"] is None  # the chain simulation says nothing about a tree
    assert {p["id"] for p in rep["prompts"]} == {r for r in rows if sum(rows[r]["loss_mask"])}
    for p in rep["prompts"]:
        row = rows[p["id"]]
        assert p["prompt_ids"] == prompt_from_mask(row["input_ids"], row["loss_mask"])
        ids = row["input_ids"]  # the prompt ends with the generation prompt of the last assistant turn
        assert tok.decode(p["prompt_ids"]).endswith("<|assistant|>\n") and len(p["prompt_ids"]) < len(ids)
        assert 1 <= len(p["output_ids"]) <= 8 and "target_output_ids" in p
    assert rep["methods"]["eagle"]["mean_tree_nodes"] <= 6
    assert (out / "acceptance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_eval_sglang_export(setup, tiny_llama):
    from hstap.export.config import ExportConfig
    from hstap.export.stage import export

    target, tok, jsonl, run, root = setup
    exported = root / "sglang"
    export(ExportConfig(run=str(run), to="sglang", out=str(exported)))
    assert not (exported / "drafter.safetensors").exists()  # SGLang format: config.json + model.safetensors
    out = root / "report-sglang"
    evaluate(from_flags(EvalConfig, target=str(tiny_llama), drafter=str(exported), data=str(jsonl), out=str(out), k=2,
                        max_new_tokens=8, num_prompts=1, device="cpu"))
    rep = json.loads((out / "report.json").read_text())
    assert rep["lossless"] is True and rep["drafter"]["aux_layers"] == [1, 2, 3]


def test_prompt_from_mask():
    assert prompt_from_mask([1, 2, 3, 4, 5, 6, 7, 8], [0, 1, 1, 0, 0, 1, 1, 0]) == [1, 2, 3, 4, 5]
    assert prompt_from_mask([1, 2, 3], [0, 1, 1]) == [1]
    assert prompt_from_mask([1, 2, 3], [0, 0, 0]) is None
    assert prompt_from_mask([1, 2], [1, 1]) is None  # nothing before the answer


def test_lossless_violation_fails_loudly(setup, tiny_llama, monkeypatch, capsys):
    import hstap.speculative.evaluate as ev

    target, tok, jsonl, run, root = setup
    real = ev.speculative_generate

    def broken(*a, **kw):  # a decoder bug stand-in: the fourth token is replaced by a clearly worse one
        out, stats = real(*a, **kw)
        if len(out) > 3:
            out = out[:3] + [(out[3] + 1) % 400] + out[4:]
        return out, stats

    monkeypatch.setattr(ev, "speculative_generate", broken)
    out = root / "report-broken"
    with pytest.raises(HstapError, match="lossless"):
        evaluate(from_flags(EvalConfig, target=str(tiny_llama), drafter=str(run), data=str(jsonl), out=str(out), k=2,
                            max_new_tokens=8, device="cpu", num_prompts=1))
    rep = json.loads((out / "report.json").read_text())  # the report is written before failing
    assert rep["lossless"] is False and len(rep["mismatches"]) == 1
    m = rep["mismatches"][0]
    assert m["position"] == 3 and m["near_tie"] is False and m["logit_gap"] > 1e-3
    assert "LOSSLESSNESS VIOLATION" in capsys.readouterr().err


def test_near_ties_are_one_line_and_still_lossless(setup, tiny_llama, monkeypatch, capsys):
    """The same swapped tokens, now within --tie-tol of the top logit: one console line with their count, the details
    in report.json, and report.md says why the run still counts as lossless."""
    import hstap.speculative.evaluate as ev

    target, tok, jsonl, run, root = setup
    real = ev.speculative_generate

    def swapped(*a, **kw):
        out, stats = real(*a, **kw)
        return (out[:3] + [(out[3] + 1) % 400] + out[4:] if len(out) > 3 else out), stats

    monkeypatch.setattr(ev, "speculative_generate", swapped)
    out = root / "report-ties"
    evaluate(from_flags(EvalConfig, target=str(tiny_llama), drafter=str(run), data=str(jsonl), out=str(out), k=2,
                        max_new_tokens=8, device="cpu", tie_tol=1e9))
    rep = json.loads((out / "report.json").read_text())
    assert rep["lossless"] is True and len(rep["mismatches"]) == 2 and all(m["near_tie"] for m in rep["mismatches"])
    lines = [x for x in capsys.readouterr().err.splitlines() if "near-tie" in x]
    assert len(lines) == 1 and "2 near-tie mismatch(es)" in lines[0] and "{" not in lines[0]
    assert "2 of them are near-ties" in (out / "report.md").read_text()


def test_read_sim_tau(setup, tmp_path):
    run = setup[3]
    assert read_sim_tau(str(run))["sim_tau"] == 0.52  # RUN resolves to best/, whose step is 20
    assert read_sim_tau(str(run / "best"))["acc_cond"] == [0.4, 0.2, 0.5]
    rec = {"acc_cond": [0.4, 0.2, 0.5]}
    assert sim_chain_tau(rec, 2) == pytest.approx(1.48) and sim_chain_tau({"acc_cond": [0.4, 0.2]}, 3) is None
    assert sim_chain_tau({**rec, "sim_chain_tau": [1.3, 1.4, 1.45]}, 2) == 1.4  # the replayed figure first
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000030"
    ckpt.mkdir(parents=True)
    (tmp_path / "run" / "metrics.jsonl").write_text((run / "metrics.jsonl").read_text())
    (ckpt / "drafter.safetensors").write_bytes(b"")  # only its presence matters here
    assert read_sim_tau(str(ckpt))["sim_tau"] == 0.375  # no trainer_state.json: the last eval line
    assert read_sim_tau(str(tmp_path / "nothing")) is None


def test_config_validation_and_cli_flags(tmp_path):
    from hstap.cli import field_docs, make_config

    argv = ["--target", "t", "--data", "d", "--out", "o", "--mode", "tree", "--topk", "4", "--eval.tokens", "20",
            "--num-prompts", "3", "--baseline", "ngram"]
    cfg = make_config("eval", EvalConfig, argv)
    assert (cfg.decode.mode, cfg.decode.topk, cfg.decode.tokens, cfg.num_prompts, cfg.baseline) == (
        "tree", 4, 20, 3, "ngram")
    assert cfg.drafter is None and cfg.target.startswith("/")
    docs = field_docs(EvalConfig)
    assert all(docs.get(f) for f in EvalConfig.__dataclass_fields__)  # every field has its help text
    for bad, match in ((dict(k=0), "--k"), (dict(tokens=1), "--tokens"), (dict(temperature=-1.0), "--temperature"),
                       (dict(mode="beam"), "--mode"), (dict(num_prompts=0), "--num-prompts")):
        with pytest.raises(HstapError, match=match):
            from_flags(EvalConfig, target="t", data="d", out="o", **bad)
    with pytest.raises(HstapError, match="no usable prompt"):
        (tmp_path / "x.jsonl").write_text(json.dumps(CONVERSATIONS[2]) + "\n")
        from hstap.data.prompts import load_prompts
        load_prompts(str(tmp_path / "x.jsonl"), object())


@pytest.mark.slow
def test_training_sim_tau_is_the_tau_eval_measures(tiny_tokenizer, tmp_path):
    """One definition of tau (tokens per target forward, the bonus token included) in training and eval: on a store
    of the target's own greedy answers, the training run's sim_tau (its replayed chain of --ttt drafts) equals the tau
    `hstap eval` measures on the same prompts with k = --ttt, and eval reports it as the simulated tau."""
    import contextlib
    import io

    import torch

    from hstap.demo.toy import build_random_target
    from helpers.train import greedy_drafter, metrics

    tok, K, n_new = tiny_tokenizer[0], 3, 24
    model = build_random_target(tmp_path / "target", tok, num_layers=6, hidden_size=64, seed=5)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)  # peaked: greedy answers a drafter can learn
    model.save_pretrained(str(tmp_path / "target"))
    greedy, run = greedy_drafter(tmp_path / "target", tmp_path, K, n_new)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rep = evaluate(from_flags(EvalConfig, target=str(tmp_path / "target"), drafter=str(run), data=str(greedy),
                                  out=str(tmp_path / "rep"), k=K, max_new_tokens=n_new, device="cpu"))
    sim = metrics(run)[1][-1]["sim_tau"]
    assert rep["lossless"] is True and rep["simulated_tau"] == sim  # eval reports training's figure as is
    assert rep["tau"] > 1.3, rep["tau"]  # the drafter accepts runs: the comparison says something
    # equal up to a rare argmax flip between the stored (batched prefill) and the decoded (KV cache) float paths
    assert rep["tau"] == pytest.approx(sim, rel=0.02), (rep["tau"], sim)


# ---------------------------------------------------------------------------------------------------------------------
# bad inputs: one error line naming the file / field / flag, exit 2, nothing written or rewritten


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """Another target (its own 300-id tokenizer, hidden 48), a drafter of it as a training run and as SGLang and vLLM
    exports, and a set prepared with its tokenizer: a user's inputs that belong to another target than tiny_llama."""
    import contextlib
    import io

    from helpers.capture import make_prepared

    from hstap.export.config import ExportConfig
    from hstap.export.stage import export
    from hstap.demo.toy import build_random_target, build_tokenizer, sample_texts

    root = tmp_path_factory.mktemp("other")
    tok = build_tokenizer(sample_texts()[::-1], vocab_size=300)
    build_random_target(root / "target", tok, num_layers=6, hidden_size=48, seed=5)
    target, _ = load_tiny_target(root / "target")
    save_drafter(root / "run" / "best", random_drafter(target, (1, 2, 3), draft_vocab=100))
    with contextlib.redirect_stdout(io.StringIO()):
        for to in ("sglang", "vllm"):
            export(ExportConfig(run=str(root / "run"), to=to, out=str(root / to), target=str(root / "target")))
    return {"run": root / "run", "sglang": root / "sglang", "vllm": root / "vllm",
            "prepared": make_prepared(root / "target", root / "prepared", n=4)}


@pytest.mark.parametrize("case", ["prompts of another tokenizer", "SGLang export of another target",
                                  "vLLM export of another target", "vLLM export, --engine vllm",
                                  "run of another target", "drafter of another tokenizer", "a finished report"])
def test_bad_inputs_are_one_line_and_write_nothing(case, setup, other, tiny_llama, tmp_path, capsys):
    """Eval refuses, in one line and before any model loads: prompts prepared with another tokenizer (else a full
    report of another vocabulary's ids); a drafter of another target as an export (else a raw state-dict size
    mismatch, for vLLM's half too) or as a run (else an error only after the whole target-only decoding, and an empty
    report directory); a drafter trained with another tokenizer; a report directory that holds a report, without
    --overwrite."""
    import shutil

    from helpers.refusals import refused

    _, _, jsonl, run, _ = setup
    out, data, drafter, opts = tmp_path / "report", jsonl, run, []
    if case == "prompts of another tokenizer":
        data, expect = other["prepared"], [f"{other['prepared']}/meta.json:1: tokenizer_sha256", str(tiny_llama)]
    elif case.startswith(("SGLang", "vLLM")):
        drafter = other["sglang" if case.startswith("SGLang") else "vllm"]
        opts = ["--engine", "vllm"] if "--engine" in case else []
        expect = [f"{drafter}/config.json: vocab_size: the drafter was made for a target of 300 token ids",
                  f"{tiny_llama} has 400"]
    elif case == "run of another target":
        drafter, expect = other["run"], [f"{other['run']}/best/drafter.json: vocab_size", "a drafter of another target"]
    elif case == "drafter of another tokenizer":
        drafter = tmp_path / "run"
        shutil.copytree(run, drafter)
        meta = json.loads((drafter / "best" / "drafter.json").read_text())
        meta["store"] = {"target": {"tokenizer_sha256": "0" * 64}}  # trained on states of a target with another one
        (drafter / "best" / "drafter.json").write_text(json.dumps(meta))
        expect = [f"{drafter}/best/drafter.json: target.tokenizer_sha256", "another vocabulary's"]
    else:
        evaluate(from_flags(EvalConfig, target=str(tiny_llama), drafter=str(run), data=str(jsonl), out=str(out), k=2,
                            max_new_tokens=4, num_prompts=1, device="cpu"))
        expect = [f"{out}: --out: holds a report already", "--overwrite"]
    argv = ["eval", "--target", tiny_llama, "--drafter", drafter, "--data", data, "--out", out, "--k", "2",
            "--max-new-tokens", "4", "--num-prompts", "1", "--device", "cpu", *opts]
    refused(argv, capsys, *expect, untouched=[out])
    if case == "a finished report":  # --overwrite replaces it
        evaluate(from_flags(EvalConfig, target=str(tiny_llama), drafter=str(run), data=str(jsonl), out=str(out), k=2,
                            max_new_tokens=4, num_prompts=1, device="cpu", overwrite=True))
