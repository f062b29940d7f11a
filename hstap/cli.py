"""The `hstap` command line, generated from each stage's `@dataclass` config.

Every field of a stage config becomes a flag, spelled `--max-len`, `--max_len` or `--prepare.max_len` (the dotted form
is the one `--config` files and `config.json` use). The field's docstring is its help text, so each default and each
explanation exists in exactly one place. A section field (`hstap.config`: the serve loop's and the demo's
`train: HyperParams`) gives one flag per field of the section: `--train.lr` (or `--train-lr`), its default the
section's; a `FLAT` section's fields keep their own names (train's `--lr`, `--store`; also `--hyper.lr`).
`--config run.yaml` loads values (YAML or JSON: a flat mapping, a mapping under the stage name, or an artifact's
`config.json`; a section as a mapping or as dotted keys, a `FLAT` section's fields also at the top level, as an
earlier flat config.json holds them), each checked against its field's type as strictly as a flag (`check_value`: one
error line naming the file and the field), and flags given on the command line override them, so
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
import math
import os
import re
import sys
import time
import textwrap
import types
import typing
from pathlib import Path
from typing import Any

from hstap.common import HstapError, one_line, user_message
from hstap.config import FieldError
from hstap.stage_paths import check_input_paths, check_output_paths

# subcommand -> (module of its config, config class, entry function, one-line help). Only stages that work are listed.
# An entry "module:function" lives in another module than its config: a config whose fields more than its entry module
# reads has a module of its own below them all (`train`: hstap/train/config.py); `generate` is the capture stage's
# composition (--capture). A config module loads no torch, numpy nor transformers: `hstap STAGE --help`, a bad value
# and a missing input path (`hstap.stage_paths`) are answered before the stage's own module loads them.
COMMANDS: dict[str, tuple[str, str, str, str]] = {
    "demo": ("hstap.demo.config", "DemoConfig", "hstap.demo.stage:demo",
             "the whole pipeline end to end, offline, on a toy target (or yours)"),
    "convert": ("hstap.convert", "ConvertConfig", "convert",
                "a GGUF file, or an installed package holding one, -> a plain HF model directory (checked)"),
    "data": ("hstap.data.sources", "DataConfig", "data",
             "ShareGPT (salvaged, cleaned) or MT-bench (turn 1 / turn 2 prompts) from their pip packages -> JSONL"),
    "prepare": ("hstap.data.prepare_config", "PrepareConfig", "hstap.data.prepare:prepare",
                "conversations -> input_ids + assistant loss_mask + draft vocab map"),
    "generate": ("hstap.data.generate_config", "GenerateConfig", "hstap.capture.tap:generate",
                 "regenerate assistant turns with the target (embedded, or an OpenAI-compatible server)"),
    "capture": ("hstap.capture.config", "CaptureConfig", "hstap.capture.stage:capture",
                "run the target over a prepared set and store its hidden states"),
    "train": ("hstap.train.config", "TrainConfig", "hstap.train.stage:train",
              "train an EAGLE-3 drafter on a store (offline) or a live target (online)"),
    "export": ("hstap.export.config", "ExportConfig", "hstap.export.stage:export",
               "drafter -> SGLang / vLLM (speculators) / hf checkpoint, validated"),
    "eval": ("hstap.speculative.config", "EvalConfig", "hstap.speculative.evaluate:evaluate",
             "speculative decoding (chain/tree) vs target-only: tau, per-position acceptance, speedup, losslessness"),
    "serve": ("hstap.data.serve", "ServeConfig", "serve",
              "a minimal OpenAI-compatible server over the embedded engine (tests, local generate --server runs)"),
    "serve-loop": ("hstap.serve_loop.config", "ServeLoopConfig", "hstap.serve_loop.stage:serve_loop",
                   "train as you serve: vLLM serves with an EAGLE-3 drafter and taps, a follow trainer, live updates"),
    "verify": ("hstap.verify.config", "VerifyConfig", "hstap.verify.stage:verify",
               "store integrity, recompute vs the target, layer-offset detection, compare two stores"),
}


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


def _optional(tp: Any) -> bool:
    """Whether a field annotation admits None (`X | None`)."""
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)


def _default(f: dataclasses.Field) -> Any:
    """A field's default value (None for a required field)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None  # type: ignore[misc]


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _section(tp: Any) -> type | None:
    """The dataclass of a nested section field (`train: HyperParams`), else None."""
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def _parse_float(s: str) -> float:
    """A float flag's value: a finite number (nan and inf are no setting: `hstap.config.positive`)."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {s!r}")
    return v


def _parse_bool(s: str) -> bool:
    v = s.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {s!r}")


def options(cls: type) -> list[tuple[tuple[str, ...], dataclasses.Field, Any, str, Any]]:
    """(path, field, annotation, docstring, default) of every option of a config: each field, and each field of a
    nested section (path ("train", "lr"), its default that of the section's default), in the fields' order."""
    docs, hints = field_docs(cls), typing.get_type_hints(cls)
    out = []
    for f in (f for f in dataclasses.fields(cls) if f.init):
        sec = _section(hints[f.name])
        if sec is None:
            out.append(((f.name,), f, hints[f.name], docs.get(f.name, ""), _default(f)))
            continue
        base, sdocs, shints = _default(f), field_docs(sec), typing.get_type_hints(sec)
        out += [((f.name, g.name), g, shints[g.name], sdocs.get(g.name, ""), getattr(base, g.name))
                for g in dataclasses.fields(sec) if g.init]
    return out


def build_parser(stage: str, cls: type, helptext: str) -> argparse.ArgumentParser:
    # A one-line usage: an argparse error prints it and one `error:` line, not every option (`--help` lists them).
    p = argparse.ArgumentParser(prog=f"hstap {stage}", description=helptext,
                                usage=f"hstap {stage} [options] (--help lists them)",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    p.add_argument("--config", metavar="FILE", help="YAML/JSON with values for this stage (an artifact's config.json replays it)")
    for path, f, hint, doc, default in options(cls):
        tp, is_list = _base_type(hint)
        dotted, dashed = ".".join(path), "-".join(path).replace("_", "-")
        flat = len(path) > 1 and cls.__dataclass_fields__[path[0]].metadata.get("flat")
        if len(path) == 1:  # --max-len --max_len --prepare.max_len
            names = [f"--{dashed}", f"--{dotted}", f"--{stage}.{dotted}"]
        elif flat:  # a FLAT section's: --batch-tokens --batch_tokens --train.batch_tokens --hyper.batch-tokens
            own = path[1].replace("_", "-")
            names = [f"--{own}", f"--{path[1]}", f"--{stage}.{path[1]}", f"--{path[0]}.{own}", f"--{dotted}"]
            dashed = own
        else:  # a section's: --train.batch-tokens --train.batch_tokens --train-batch-tokens --demo.train.batch_tokens
            names = [f"--{path[0]}.{path[1].replace('_', '-')}", f"--{dotted}", f"--{dashed}", f"--{stage}.{dotted}"]
        names = list(dict.fromkeys(names))
        # argparse %-formats help strings: a literal % in a docstring must be doubled
        kw: dict[str, Any] = {"dest": dotted, "default": argparse.SUPPRESS, "help": doc.replace("%", "%%")}
        if default is not None and default != []:
            kw["help"] += f" (default: {default})".replace("%", "%%")
        elif len(path) == 1 and _required(f):
            kw["help"] += " (required)"
        if "choices" in f.metadata:
            kw["choices"] = f.metadata["choices"]
        if tp is bool:
            kw.update(nargs="?", const=True, type=_parse_bool, metavar="BOOL")
            p.add_argument(*names, **kw)
            p.add_argument(f"--no-{dashed}", dest=dotted, action="store_false", default=argparse.SUPPRESS,
                           help=argparse.SUPPRESS)
            continue
        kw["type"] = _parse_float if tp is float else tp
        kw["metavar"] = tp.__name__.upper() if tp in (int, float) else "STR"
        if is_list:
            kw["nargs"] = "+"
        p.add_argument(*names, **kw)
    return p


def _yaml_loader():
    """yaml.SafeLoader that also reads `3e-3` as a float (YAML 1.1, PyYAML's, reads a float without a dot as a
    string; YAML 1.2 and JSON read it as a number)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    number = re.compile(r"^[-+]?[0-9][0-9_]*(\.[0-9_]*)?[eE][-+]?[0-9]+$")
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", number, list("-+0123456789"))
    return Loader


def load_config_file(path: str, stage: str) -> dict:
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise HstapError(f"{path}: cannot read config: {e.strerror if isinstance(e, OSError) else e}") from None
    try:
        if path.endswith((".yaml", ".yml")):
            import yaml
            data = yaml.load(text, Loader=_yaml_loader())  # noqa: S506 - a SafeLoader
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


_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
_PLURAL = {bool: "booleans", int: "integers", float: "numbers", str: "strings"}


def check_value(where: str, hint: Any, meta: Any, v: Any) -> Any:
    """A `--config` file's value of one field (annotation `hint`, metadata `meta`), checked against the field's type
    as strictly as the command line checks a flag's: an integer field takes no 2.5 nor "10", a boolean no "no", a
    number no "0.003"; a list field takes a list (or one string); a layer-list field a comma string or a list of ints.
    `where` ("FILE: field") starts the one error line. Returns the value as the config takes it."""
    from hstap.config import LAYER_WORDS
    from hstap.layers import parse_ids

    tp, is_list = _base_type(hint)
    if v is None:
        if _optional(hint):
            return None
        raise HstapError(f"{where}: expected {_KINDS.get(tp, 'a value')}, got null")
    if meta.get("layers"):
        if isinstance(v, str):
            if v.strip() and v.strip() not in LAYER_WORDS:
                parse_ids(v, where)
            return v
        if isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            return v
        raise HstapError(f"{where}: expected layer ids (a comma-separated string or a list of integers), got {v!r}")
    if is_list:
        v = [v] if isinstance(v, str) else v
        if not isinstance(v, list):
            raise HstapError(f"{where}: expected a list of {_PLURAL.get(tp, 'values')}, got {v!r}")
        return [check_value(where, tp, meta, x) for x in v]
    ok = {bool: lambda x: isinstance(x, bool), int: lambda x: isinstance(x, int) and not isinstance(x, bool),
          float: lambda x: isinstance(x, (int, float)) and not isinstance(x, bool),
          str: lambda x: isinstance(x, str)}.get(tp, lambda x: True)
    if not ok(v) or (tp is float and not math.isfinite(v)):
        raise HstapError(f"{where}: expected {'a finite number' if ok(v) else _KINDS[tp]}, got {v!r}")
    if "choices" in meta and v not in meta["choices"]:
        raise HstapError(f"{where}: expected one of {', '.join(map(str, meta['choices']))}, got {v!r}")
    return float(v) if tp is float else v


def file_values(path: str, stage: str, cls: type) -> dict:
    """The values of a `--config` file for `cls`, each checked against its field (`check_value`): {field: value}, a
    section's as {section: {field: value}} (a nested mapping or dotted keys, `train.lr`; a `FLAT` section's fields
    also by their own names, `lr`). Keys may carry the stage (`prepare.max_len`) and use dashes."""
    from hstap.config import flat_names

    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints, flat = typing.get_type_hints(cls), flat_names(cls)
    out: dict[str, Any] = {}
    for key, v in load_config_file(path, stage).items():
        parts = str(key).replace("-", "_").split(".")
        if len(parts) > 1 and parts[0] == stage.replace("-", "_"):
            parts = parts[1:]
        if len(parts) == 1 and parts[0] not in fields and parts[0] in flat:  # `lr`: the field of a FLAT section
            sec = flat[parts[0]]
            g = {g.name: g for g in dataclasses.fields(hints[sec])}[parts[0]]
            out.setdefault(sec, {})[g.name] = check_value(f"{path}: {g.name}", typing.get_type_hints(hints[sec])[
                g.name], g.metadata, v)
            continue
        f = fields.get(parts[0])
        sec = _section(hints[f.name]) if f is not None else None
        if f is None or (sec is None and len(parts) > 1):
            raise HstapError(f"{path}: unknown field {key!r} for stage {stage!r}")
        if sec is None:
            out[f.name] = check_value(f"{path}: {f.name}", hints[f.name], f.metadata, v)
            continue
        if len(parts) == 1 and not isinstance(v, dict):
            raise HstapError(f"{path}: {f.name}: expected a mapping of {f.name}'s fields, got {v!r}")
        sub = v if len(parts) == 1 else {".".join(parts[1:]): v}
        sfields, shints = {g.name: g for g in dataclasses.fields(sec) if g.init}, typing.get_type_hints(sec)
        for skey, sv in sub.items():
            g = sfields.get(str(skey).replace("-", "_"))
            if g is None:
                raise HstapError(f"{path}: unknown field {f.name + '.' + str(skey)!r} for stage {stage!r}")
            out.setdefault(f.name, {})[g.name] = check_value(f"{path}: {f.name}.{g.name}", shints[g.name],
                                                             g.metadata, sv)
    return out


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
    """The stage's config from its command line: a `--config` file's values (`file_values`), then the flags over them
    (a section's field by field over the section's default). A field's value refused by its config (`FieldError`) is
    named as the user gave it: the flag as typed, or the `--config` file and the field's key."""
    parser = build_parser(stage, cls, helptext)
    args = join_dash_values(parser, argv)
    ns = vars(parser.parse_args(args))
    cfg_file = ns.pop("config", None)
    values = file_values(cfg_file, stage, cls) if cfg_file else {}
    in_file = {f"{k}.{g}" if isinstance(v, dict) else k for k, v in values.items() for g in (v if isinstance(v, dict)
                                                                                           else [None])}
    typed = {parser._option_string_actions[a.split("=", 1)[0]].dest: a.split("=", 1)[0] for a in args
             if a.split("=", 1)[0] in parser._option_string_actions}
    for dest, v in ns.items():
        sec, _, name = dest.rpartition(".")
        (values.setdefault(sec, {}) if sec else values)[name] = v
    fields = [f for f in dataclasses.fields(cls) if f.init]
    missing = [f.name for f in fields if f.name not in values and _required(f)]
    if missing:
        parser.error("the following arguments are required: " + ", ".join("--" + m.replace("_", "-") for m in missing))
    hints = typing.get_type_hints(cls)
    sec = ""
    try:
        for f in fields:
            if _section(hints[f.name]) is not None and f.name in values:
                sec = f.name
                values[f.name] = dataclasses.replace(_default(f), **values[f.name])
        sec = ""
        return cls(**values)
    except FieldError as e:
        dest = f"{sec}.{e.name}" if sec else e.name
        if dest in typed:
            raise HstapError(f"{stage}: {typed[dest]}: {e.reason}") from None
        if dest in in_file:  # the key as the file may hold it: a FLAT section's field by its own name
            key = e.name if sec and cls.__dataclass_fields__[sec].metadata.get("flat") else dest
            raise HstapError(f"{cfg_file}: {key}: {e.reason}") from None
        raise HstapError(f"{stage}: --{dest.replace('_', '-')}: {e.reason}") from None
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
        check_output_paths(stage, cfg)
        stage_entry(stage)(cfg)
    except HstapError as e:
        print(f"hstap: error: {user_message(e)}", file=sys.stderr)
        return 2
    except OSError as e:
        if e.filename is None:  # not about a path: a bug or the system's, with its traceback
            raise
        # a path the checks could not foresee (a disk that filled, a directory removed under the run): one line
        print(f"hstap: error: {e.filename}: {e.strerror or one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hstap: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
