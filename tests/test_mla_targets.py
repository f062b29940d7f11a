"""DeepSeek-V3 and Kimi-K2.5 targets (MLA attention + MoE) through hstap, built in-process by hstap.demo.toy: a tiny
DeepseekV3 causal LM, and the same model (same arguments, same weights) in Kimi-K2.5's multimodal layout
(`KimiK25ForConditionalGeneration`, the language model's config under `text_config`, its tensors under
`language_model.` beside a vision tower and projector).

- The Kimi layout is what transformers' own Kimi_K25ForConditionalGeneration loads, and hstap loads its language model
  alone, tensor for tensor the causal LM's, with the same logits.
- The head hstap trains against is the lm_head, never the embedding, unless the config ties them; a head that cannot be
  found is one error line naming the file and the names tried.
- prepare -> capture (hf, the 6-layer default taps) -> verify -> train -> export (SGLang, vLLM) -> eval run on both, and
  the wrapper changes nothing hstap computes: the same stores, verify figures, losses step for step, exports and
  acceptance.
- The exports are read back by the engines' own config code: vLLM's SpeculatorsConfig and speculators' config class in
  this venv, SGLang's get_config in the SGLang server venv (a subprocess), and SGLang's DeepSeek layer-capture rule (its
  source, executed here) turns the export's ids into the captured layers the drafter was trained on.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import shutil
import subprocess
import types
from pathlib import Path
from typing import List, Optional

import pytest
import torch
from safetensors.torch import load_file, save_file

from hstap.common import HstapError
from hstap.layers import sglang_capture_inputs, to_sglang, to_vllm
from hstap.artifacts.model_dir import load_config, load_target, target_fingerprint, target_head, text_weights

REPO = Path(__file__).resolve().parent.parent
KINDS = ("deepseek_v3", "kimi_k25")
DEFAULT_TAPS = [1, 3, 4]  # the 6-layer default (hstap.layers.default_aux_layers)


@pytest.fixture(scope="module")
def targets(tiny_tokenizer, tmp_path_factory) -> dict[str, Path]:
    """{"deepseek_v3": the causal LM's directory, "kimi_k25": the same model in Kimi-K2.5's layout}: 6 layers, H=64,
    MLA with a q LoRA (as DeepSeek-V3 and Kimi have), 4 routed experts + 1 shared, untied lm_head."""
    from hstap.demo.toy import build_random_target

    root = tmp_path_factory.mktemp("mla")
    for kind in KINDS:
        build_random_target(root / kind, tiny_tokenizer[0], model_type=kind, num_layers=6, hidden_size=64,
                            q_lora_rank=16, seed=3)
    return {kind: root / kind for kind in KINDS}


def _ids(n: int = 11, seed: int = 0) -> torch.Tensor:
    return torch.randint(6, 400, (2, n), generator=torch.Generator().manual_seed(seed))  # (B, T)


# ---------------------------------------------------------------------------------------------------------------------
# loading the language model of the wrapper


def test_kimi_layout_loads_as_its_language_model(targets):
    from transformers import Kimi_K25ForConditionalGeneration

    ds, kimi = targets["deepseek_v3"], targets["kimi_k25"]
    conf = json.loads((kimi / "config.json").read_text())
    assert conf["architectures"] == ["KimiK25ForConditionalGeneration"] and conf["model_type"] == "kimi_k25"
    assert conf["text_config"]["model_type"] == "kimi_k2" and conf["tie_word_embeddings"] is False
    names = set(load_file(str(kimi / "model.safetensors")))
    assert "language_model.lm_head.weight" in names and "language_model.model.embed_tokens.weight" in names
    assert any(n.startswith("vision_tower.encoder.blocks.") for n in names) and "mm_projector.proj.0.weight" in names
    # transformers' own Kimi-K2.5 class takes the layout as it is: nothing missing, nothing left over
    wrapper, info = Kimi_K25ForConditionalGeneration.from_pretrained(str(kimi), dtype=torch.float32,
                                                                     output_loading_info=True)
    assert not any(info.values()), info
    a, b = load_target(ds)[0], load_target(kimi)[0]
    assert type(b.model).__name__ == "DeepseekV3ForCausalLM"  # the language model alone: no vision tower loaded
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    x = _ids()
    with torch.no_grad():
        ref = wrapper(input_ids=x).logits  # (B, T, V)
        assert torch.equal(b.model(x).logits, ref) and torch.equal(a.model(x).logits, ref)
    fa, fb = target_fingerprint(ds), target_fingerprint(kimi)
    assert {k: fb[k] for k in ("num_layers", "hidden_size", "vocab_size")} == {"num_layers": 6, "hidden_size": 64,
                                                                                "vocab_size": 400}
    assert fb["model_type"] == "kimi_k2" and fa["model_type"] == "deepseek_v3"
    assert fb["tokenizer_sha256"] == fa["tokenizer_sha256"] and fb["weights_fingerprint"] != fa["weights_fingerprint"]
    assert load_config(kimi).num_hidden_layers == 6 and b.num_layers == 6 and b.vocab_size == 400


def test_the_head_is_the_lm_head(targets):
    """target_head (what train takes its targets from) is the model's own lm_head: final states times it are the
    model's logits; the embedding would give other logits."""
    heads = {kind: target_head(d) for kind, d in targets.items()}
    (e1, h1), (e2, h2) = heads["deepseek_v3"], heads["kimi_k25"]
    assert torch.equal(e1, e2) and torch.equal(h1, h2) and not torch.equal(h1, e1)
    t = load_target(targets["kimi_k25"])[0]
    x = _ids()
    with torch.no_grad():
        logits = t.model(x).logits  # (B, T, V)
        _, final, _ = t.capture(x, [])  # (B, T, H)
    torch.testing.assert_close(final @ h2.T, logits, rtol=1e-5, atol=1e-5)
    assert torch.equal((final @ h2.T).argmax(-1), logits.argmax(-1))
    assert (final @ e2.T - logits).abs().max() > 1.0
    w = text_weights(targets["kimi_k25"])
    assert (w.base, w.head, w.tied) == ("language_model.model.", "language_model.lm_head.weight", False)
    assert w.key_mapping() == {r"^language_model\.model\.": "model.", r"^language_model\.lm_head\.": "lm_head."}


def _variant(src: Path, dst: Path, drop: str | None = None, conf=None) -> Path:
    """A copy of a target directory without tensor `drop` and with `conf(config dict)` applied to its config.json."""
    shutil.copytree(src, dst)
    if drop is not None:
        state = load_file(str(dst / "model.safetensors"))
        del state[drop]
        save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if conf is not None:
        c = json.loads((dst / "config.json").read_text())
        conf(c)
        (dst / "config.json").write_text(json.dumps(c))
    return dst


def test_a_missing_head_is_an_error_unless_tied(targets, tmp_path):
    kimi, ds = targets["kimi_k25"], targets["deepseek_v3"]
    headless = _variant(kimi, tmp_path / "headless", drop="language_model.lm_head.weight")
    with pytest.raises(HstapError) as e:
        target_head(headless)
    msg = str(e.value)
    assert msg.startswith(str(headless / "model.safetensors")) and "\n" not in msg
    assert "tried language_model.lm_head.weight, lm_head.weight" in msg and "tie_word_embeddings false" in msg
    with pytest.raises(HstapError, match="no lm_head"):
        load_target(headless)  # transformers would have run a randomly initialised head
    # transformers reads the wrapper's flag, not text_config's: a tie stated only there ties nothing
    inner = _variant(headless, tmp_path / "inner", conf=lambda c: c["text_config"].update(tie_word_embeddings=True))
    with pytest.raises(HstapError, match="no lm_head"):
        target_head(inner)
    tied = _variant(headless, tmp_path / "tied", conf=lambda c: c.update(tie_word_embeddings=True))
    e, h = target_head(tied)
    assert h is e and torch.equal(e, target_head(kimi)[0])
    t = load_target(tied)[0]
    assert torch.equal(t.lm_head.weight, e)  # transformers ties it: the embedding is the head
    # no top-level flag: Kimi_K25Config's default ties, but a stored head that differs is what transformers runs
    default = _variant(kimi, tmp_path / "default", conf=lambda c: c.pop("tie_word_embeddings"))
    assert text_weights(default).tied and torch.equal(target_head(default)[1], target_head(kimi)[1])
    assert torch.equal(load_target(default)[0].lm_head.weight, target_head(kimi)[1])
    # a causal LM: the same rule, one name tried
    plain = _variant(ds, tmp_path / "plain", drop="lm_head.weight")
    with pytest.raises(HstapError, match=r"model.safetensors: no lm_head .*\(tried lm_head.weight\)"):
        target_head(plain)
    with pytest.raises(HstapError, match=r"model.safetensors: no lm_head .*\(tried lm_head.weight\)"):
        load_target(plain)  # found before transformers builds the model
    two = _variant(ds, tmp_path / "two")
    state = load_file(str(two / "model.safetensors"))
    state["other.model.embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, str(two / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(HstapError, match="several embeddings"):
        target_head(two)


TEXT_CONFIGS = {"a string": (lambda c: c.update(text_config="kimi_k2"), "text_config: a wrapper", 'got "kimi_k2"'),
                "null": (lambda c: c.update(text_config=None), "text_config: a wrapper", "got null"),
                "missing": (lambda c: c.pop("text_config"), "text_config: a Kimi_K25Config", "it is missing"),
                "another hidden size": (lambda c: c["text_config"].update(hidden_size=32),
                                        "text_config.hidden_size: 32, but the checkpoint's", "the config of another"),
                "another vocabulary": (lambda c: c["text_config"].update(vocab_size=999),
                                       "text_config.vocab_size: 999, but the checkpoint's", "the config of another"),
                "fewer layers": (lambda c: c["text_config"].update(num_hidden_layers=4),
                                 "text_config.num_hidden_layers: 4, but the checkpoint holds 6", "another model")}


@pytest.mark.parametrize("case", list(TEXT_CONFIGS))
def test_a_kimi_text_config_not_of_its_language_model_is_one_line(case, targets, small_run, tmp_path, capsys):
    """A Kimi-K2.5 config.json whose text_config is not its language model's: a string, null or missing (transformers
    would build its default Kimi-K2 in its place) or of another size than the checkpoint: capture and generate refuse
    it in one line naming the field, before any model is built, nothing written."""
    from helpers.refusals import refused

    edit, *expect = TEXT_CONFIGS[case]
    bad = _variant(targets["kimi_k25"], tmp_path / "bad", conf=edit)
    out = tmp_path / "out"
    refused(["capture", "--target", bad, "--data", small_run["prepared"], "--out", out, "--layers", "1,2,3"], capsys,
            f"{bad / 'config.json'}: ", *expect, untouched=[out])
    refused(["generate", "--target", bad, "--data", small_run["chats"], "--out", out, "--max-new-tokens", "2"], capsys,
            f"{bad / 'config.json'}: ", *expect, untouched=[out, tmp_path / "out.config.json"])


# ---------------------------------------------------------------------------------------------------------------------
# the pipeline on both: the wrapper changes nothing hstap computes


def _quiet(fn, *a, **kw):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return fn(*a, **kw)


@pytest.fixture(scope="module")
def pipeline(targets, tmp_path_factory) -> dict[str, dict]:
    """prepare -> capture (hf, default layers) -> verify -> train (6 steps) -> export (sglang, vllm) -> eval, for each
    target: {kind: {"prepared", "store", "verify", "run", "train", "sglang", "vllm", "eval"}}."""
    from helpers.capture import corpus

    from hstap.capture.config import CaptureConfig
    from hstap.capture.stage import capture
    from hstap.data.prepare_config import PrepareConfig
    from hstap.data.prepare import prepare
    from hstap.export.config import ExportConfig
    from hstap.export.stage import export
    from hstap.config import from_flags
    from hstap.speculative.config import EvalConfig
    from hstap.speculative.evaluate import evaluate
    from hstap.train.config import TrainConfig
    from hstap.train.stage import train
    from hstap.verify.stage import recompute

    root = tmp_path_factory.mktemp("mla-pipeline")
    chats = root / "chats.jsonl"
    chats.write_text("".join(json.dumps(r) + "\n" for r in corpus(16, seed=2, max_chars=160)))
    out = {}
    for kind, target in targets.items():
        d, r = root / kind, {}
        r["prepared"] = d / "prepared"
        _quiet(prepare, PrepareConfig(tokenizer=str(target), data=[str(chats)], out=str(r["prepared"]), draft_vocab=96))
        r["store"] = d / "store"
        _quiet(capture, CaptureConfig(target=str(target), data=str(r["prepared"]), out=str(r["store"]), layers="",
                                      dtype="fp32", device="cpu", batch_tokens=2048))
        r["verify"] = _quiet(recompute, str(r["store"]), str(target), samples=4, device="cpu", compute_dtype="fp32")
        r["run"] = d / "run"
        torch.manual_seed(0)
        r["train"] = _quiet(train, from_flags(TrainConfig, store=str(r["store"]), target=str(target), out=str(r["run"]),
                                              steps=6, lr=3e-3, batch_tokens=600, ttt=2, log_every=1, eval_frac=0.25,
                                              save_every=6, device="cpu"))
        for to in ("sglang", "vllm"):
            r[to] = d / to
            _quiet(export, ExportConfig(run=str(r["run"]), to=to, out=str(r[to]), dtype="fp32", target=str(target)))
        r["eval"] = _quiet(evaluate, from_flags(EvalConfig, target=str(target), drafter=str(r["vllm"]),
                                                data=str(r["prepared"]), out=str(d / "eval"), k=2, max_new_tokens=10,
                                                num_prompts=3, device="cpu", dtype="fp32"))
        out[kind] = r
    return out


def _metrics(run: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    timing = ("tok_s", "mfu", "time", "elapsed", "step_s", "wall_s", "seconds")
    return [{k: v for k, v in r.items() if k not in timing} for r in rows]


def test_the_wrapper_changes_nothing_hstap_computes(pipeline):
    from helpers.capture import store_samples

    from hstap.data.prepare import load_prepared
    from hstap.store.reader import open_store

    a, b = pipeline["deepseek_v3"], pipeline["kimi_k25"]
    pa, pb = load_prepared(a["prepared"]), load_prepared(b["prepared"])
    assert pa["input_ids"] == pb["input_ids"] and pa["loss_mask"] == pb["loss_mask"]
    assert open_store(a["store"]).layers == open_store(b["store"]).layers == DEFAULT_TAPS  # 6 layers: a default
    sa, sb = store_samples(a["store"]), store_samples(b["store"])
    assert sorted(sa) == sorted(sb) and len(sa) == 16
    for sid, x in sa.items():
        assert all(torch.equal(x[k], sb[sid][k]) for k in ("input_ids", "loss_mask", "aux", "final")), sid
    assert a["verify"]["ok"] and b["verify"]["ok"] and a["verify"]["metrics"] == b["verify"]["metrics"]
    ma, mb = _metrics(a["run"]), _metrics(b["run"])
    assert [r["step"] for r in ma if "loss" in r] == list(range(1, 7))
    assert ma == mb  # every loss, accuracy and eval figure, step for step
    assert ma[0]["loss"] > 0
    for to in ("sglang", "vllm"):
        ca, cb = (json.loads((r[to] / "config.json").read_text()) for r in (a, b))
        if to == "vllm":  # the verifier is each target itself
            assert ca["speculators_config"].pop("verifier")["architectures"] == ["DeepseekV3ForCausalLM"]
            assert cb["speculators_config"].pop("verifier")["architectures"] == ["KimiK25ForConditionalGeneration"]
        assert ca == cb, to
        wa, wb = load_file(str(a[to] / "model.safetensors")), load_file(str(b[to] / "model.safetensors"))
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    ea, eb = a["eval"], b["eval"]
    assert ea["lossless"] is True and eb["lossless"] is True
    assert ea["tau"] == eb["tau"] >= 1.0 and ea["per_position_acceptance"] == eb["per_position_acceptance"]
    assert ea["methods"]["eagle"]["accept_counts"] == eb["methods"]["eagle"]["accept_counts"]


# ---------------------------------------------------------------------------------------------------------------------
# what the engines read from the exports


def test_vllm_and_speculators_read_the_exports(pipeline, targets):
    """vLLM's SpeculatorsConfig (what `vllm serve DRAFTER` builds the drafter from), its speculators override (which
    target it serves) and its config of the Kimi target; speculators' Eagle3SpeculatorConfig."""
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from transformers import AutoConfig
    from vllm.transformers_utils.config import get_config, get_hf_text_config, maybe_override_with_speculators
    from vllm.transformers_utils.configs.speculators import SpeculatorsConfig

    kimi, r = targets["kimi_k25"], pipeline["kimi_k25"]
    vl, sg = r["vllm"], r["sglang"]
    vd = int(json.loads((vl / "config.json").read_text())["draft_vocab_size"])
    assert 0 < vd < 400
    c = SpeculatorsConfig.from_pretrained(str(vl))
    assert c.eagle_aux_hidden_state_layer_ids == to_vllm(DEFAULT_TAPS) == [2, 4, 5]  # input of layer j
    assert (c.target_hidden_size, c.hidden_size, c.vocab_size, c.draft_vocab_size) == (64, 64, 400, vd)
    fc = load_file(str(vl / "model.safetensors"))["fc.weight"]  # (H, K * Ht)
    assert fc.shape == (64, 3 * c.target_hidden_size)
    model, tokenizer, spec = maybe_override_with_speculators(str(vl), None, trust_remote_code=False)
    assert model == tokenizer == str(kimi) and spec["method"] == "eagle3" and spec["num_speculative_tokens"] == 3
    target = get_config(str(kimi), trust_remote_code=False)
    assert target.architectures == ["KimiK25ForConditionalGeneration"]
    text = get_hf_text_config(target)
    assert (text.num_hidden_layers, text.hidden_size, text.vocab_size) == (6, c.target_hidden_size, c.vocab_size)
    # an SGLang export served by vLLM: vLLM reads the top-level ids (its numbering) before eagle_config's (SGLang's)
    assert AutoConfig.from_pretrained(str(sg)).eagle_aux_hidden_state_layer_ids == [2, 4, 5]
    s = Eagle3SpeculatorConfig.from_pretrained(str(vl))
    assert s.eagle_aux_hidden_state_layer_ids == [2, 4, 5] and (s.target_hidden_size, s.draft_vocab_size) == (64, vd)
    assert s.transformer_layer_config.vocab_size == 400
    assert s.speculators_config.verifier.architectures == ["KimiK25ForConditionalGeneration"]


SGLANG_READS = r"""
import json, sys
from sglang.srt.utils.hf_transformers_utils import get_config, get_hf_text_config
out = {}
for path in sys.argv[1:]:
    c = get_config(path, trust_remote_code=False)
    text = get_hf_text_config(c)
    out[path] = {"architectures": c.architectures, "model_type": text.model_type,
                 "num_hidden_layers": text.num_hidden_layers, "hidden_size": text.hidden_size,
                 "vocab_size": text.vocab_size, "draft_vocab_size": getattr(c, "draft_vocab_size", None),
                 "target_hidden_size": getattr(c, "target_hidden_size", None),
                 "eagle_config": getattr(c, "eagle_config", None)}
print(json.dumps(out))
"""


def _sglang_models() -> Path:
    found = sorted((REPO / ".venv-sglang").glob("lib/python3*/site-packages/sglang/srt/models"))
    if not found:
        pytest.skip("the SGLang server venv .venv-sglang/ is absent (README.md, command 2, creates it)")
    return found[0]


def _sglang_method(models: Path, module: str, cls: str, name: str):
    """SGLang's own method `cls.name` of srt/models/<module>.py, compiled from its source (importing SGLang's DeepSeek
    model would take half a minute on this CPU box)."""
    tree = ast.parse((models / f"{module}.py").read_text())
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    fn = next(n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == name)
    scope = {"List": List, "Optional": Optional}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(models / f"{module}.py"), "exec"), scope)
    return scope[name]


def sglang_captured(models: Path, ids: list[int] | None, num_layers: int) -> list[int]:
    """The layer inputs SGLang's KimiK25ForConditionalGeneration captures for draft-config ids `ids`: its
    set_eagle3_layers_to_capture hands them to its DeepseekV3ForCausalLM language model (DeepseekV2ForCausalLM's)."""
    lm = types.SimpleNamespace(pp_group=types.SimpleNamespace(is_last_rank=True), model=types.SimpleNamespace(),
                               config=types.SimpleNamespace(num_hidden_layers=num_layers))
    lm.set_eagle3_layers_to_capture = types.MethodType(
        _sglang_method(models, "deepseek_v2", "DeepseekV2ForCausalLM", "set_eagle3_layers_to_capture"), lm)
    kimi = types.SimpleNamespace(language_model=lm)
    _sglang_method(models, "kimi_k25", "KimiK25ForConditionalGeneration", "set_eagle3_layers_to_capture")(kimi, ids)
    return list(lm.model.layers_to_capture)


@pytest.mark.procs
def test_sglang_reads_the_export(pipeline, targets):
    """SGLang's get_config (the server venv) reads the export's ids, widths and vocabularies and the Kimi target's
    shape; its DeepSeek capture rule turns the ids into the inputs of the layers after the trained taps."""
    models = _sglang_models()
    kimi, sg = targets["kimi_k25"], pipeline["kimi_k25"]["sglang"]
    proc = subprocess.run([str(REPO / ".venv-sglang" / "bin" / "python"), "-c", SGLANG_READS, str(sg), str(kimi)],
                          capture_output=True, text=True, timeout=300, cwd=str(REPO))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    draft, target = got[str(sg)], got[str(kimi)]
    vd = json.loads((sg / "config.json").read_text())["draft_vocab_size"]
    ids = draft["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert draft["architectures"] == ["LlamaForCausalLMEagle3"] and draft["eagle_config"]["use_aux_hidden_state"]
    assert ids == to_sglang(DEFAULT_TAPS, target["model_type"]) == DEFAULT_TAPS
    assert (draft["target_hidden_size"], draft["vocab_size"], draft["draft_vocab_size"]) == (64, 400, vd)
    assert target["architectures"] == ["KimiK25ForConditionalGeneration"] and target["model_type"] == "kimi_k2"
    assert (target["num_hidden_layers"], target["hidden_size"], target["vocab_size"]) == (6, 64, 400)
    fc = load_file(str(sg / "model.safetensors"))["fc.weight"]  # (H, K * Ht): SGLang's K is len(ids)
    assert fc.shape == (64, len(ids) * draft["target_hidden_size"])
    captured = sglang_captured(models, ids, 6)
    assert captured == [i + 1 for i in DEFAULT_TAPS] == sglang_capture_inputs(ids, "kimi_k2")  # input of i+1 = output i
    # the 61-layer table of docs/engines.md, through SGLang's own rule
    assert sglang_captured(models, [1, 29, 57], 61) == [2, 30, 58] == to_vllm([1, 29, 57])
    assert sglang_captured(models, to_sglang([2, 30, 58], "kimi_k2"), 61) == [3, 31, 59]
    assert sglang_captured(models, None, 61) == [2, 30, 58]  # SGLang's id-less default: the same three layers
