"""What every stage config shares: the checks of its count-like, number, fraction and layer-list fields, and its
settling at parse time.

A stage config is a frozen `@dataclass` (`hstap.cli` builds it from flags or a `--config` file; a caller in Python
builds it directly): it is what the user asked, as parsed, and nothing changes it afterwards. Its `__post_init__` may
still settle a value while parsing (an absolute path, so that config.json replays the run from anywhere; a layer list
given as a list of ints, written as its comma string), through `settle`. What a run resolves from its inputs (a train
run's ce chunk, its draft vocabulary) belongs to that stage's plan, never to its config.

    @dataclass(frozen=True)
    class XConfig:
        out: str
        batch_tokens: int = 16384
        layers: str = field(default="", metadata=LAYERS)

        def __post_init__(self):
            at_least("x", self, ("batch_tokens",))
            layer_list("x", self, "layers")
            absolute(self, "out")

A config may hold sections: fields whose type is itself such a dataclass (train's `hyper: HyperParams`), each checking
its own fields, handed whole to the builder that reads them (torchtitan's `job_config.optimizer` to the optimizer
builder). A section marked `FLAT` keeps its fields' own flag names (`--lr`, not `--hyper.lr`; a `--config` file may
give them at the top level, as a flat config.json of an earlier version does); another is spelled through its field's
name (the serve loop's `--train.lr`). `from_flags` builds a config from its flags' names, `flag_values` reads it back
so; config.json holds the config as parsed, each section nested under its name.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from collections.abc import Iterable
from typing import Any

from hstap.common import HstapError

LAYERS = {"layers": True}
"""Field metadata of a layer-list field: a comma string of layer ids on the command line; in a `--config` file a
string or a list of ints (`layer_list` settles it as the string)."""

FLAT = {"flat": True}
"""Field metadata of a section whose fields keep their own flag names (`--lr`, `--keep-shards`) in the stage that holds
it: a stage's own sections (train's), or a section another stage embeds under flags it had before (the serve loop's
follow stream)."""

LAYER_WORDS = ("default", "final")
"""Words a layer-list field may hold instead of ids (each field's docstring says which of them it takes)."""


def flag(name: str) -> str:
    """The command-line spelling of a field: `batch_tokens` -> `--batch-tokens`."""
    return "--" + name.replace("_", "-")


class FieldError(HstapError):
    """One field's value refused: `where: --field: reason`, the field's flag as the config that declares it spells it.
    The command line says it again as the user gave the value (`hstap.cli.make_config`): the flag as typed (a
    section's `--train-lr` of the serve loop, not train's `--lr`), or the `--config` file and the field's key."""

    def __init__(self, where: str, name: str, reason: str):
        super().__init__(f"{where}: {flag(name)}: {reason}")
        self.where, self.name, self.reason = where, name, reason


def settle(cfg: Any, name: str, value: Any) -> None:
    """Set a field of a frozen config while it is parsed (in its `__post_init__`), never after."""
    object.__setattr__(cfg, name, value)


def absolute(cfg: Any, *names: str) -> None:
    """The path fields `names` made absolute (a list field item by item; unset ones left so), so that config.json
    replays the run from any working directory."""
    for name in names:
        v = getattr(cfg, name)
        if isinstance(v, list):
            settle(cfg, name, [os.path.abspath(p) for p in v])
        elif v:
            settle(cfg, name, os.path.abspath(v))


def at_least(where: str, cfg: Any, names: Iterable[str], lo: int = 1) -> None:
    """Every count-like field of `names` is an integer >= lo (None: unset, left to the field's meaning); the first that
    is not is one error line naming its flag. `where`: the stage, as the line starts."""
    for name in names:
        v = getattr(cfg, name)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int):
            raise FieldError(where, name, f"must be an integer >= {lo}, got {v!r}")
        if v < lo:
            raise FieldError(where, name, f"must be >= {lo}, got {v!r}")


def positive(where: str, cfg: Any, names: Iterable[str], zero: bool = False) -> None:
    """Every number field of `names` is finite and > 0 (>= 0 with `zero`); None: unset, left to the field's meaning.
    nan passes every comparison that is not made with it and inf trains a drafter of NaNs: neither is a setting. The
    first that is not is one error line naming its flag. `where`: the stage, as the line starts."""
    for name in names:
        v = getattr(cfg, name)
        if v is None:
            continue
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and (v > 0 or zero and v == 0)
        if not ok:
            raise FieldError(where, name, f"must be a finite number {'>=' if zero else '>'} 0, got {v!r}")


def fractions(where: str, cfg: Any, names: Iterable[str]) -> None:
    """Every fraction field of `names` (a share of the samples, of a slot, of a warm-up) is a number in [0, 1): 0 is
    none, and all of them would leave nothing for the rest; nan is none of them. The first that is not is one error
    line naming its flag."""
    for name in names:
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v < 1.0:
            raise FieldError(where, name, f"must be in [0, 1), got {v}")


def layer_list(where: str, cfg: Any, name: str) -> None:
    """Field `name` (a layer list, `LAYERS`): a list of ints settled as its comma string, and the string's syntax
    checked (integers, no empty item) or one of `LAYER_WORDS`; None and "" are left as they are (the default). The
    ids' range is checked against the target where it is known (`hstap.layers.parse_layers`)."""
    from hstap.layers import parse_ids

    v = getattr(cfg, name)
    if isinstance(v, (list, tuple)):
        if not v or any(isinstance(x, bool) or not isinstance(x, int) for x in v):
            raise HstapError(f"{where}: {flag(name)}: expected layer ids (a comma-separated string or a list of "
                             f"integers), got {v!r}")
        v = ",".join(str(x) for x in v)
        settle(cfg, name, v)
    if v is None:
        return
    if not isinstance(v, str):
        raise HstapError(f"{where}: {flag(name)}: expected layer ids (a comma-separated string or a list of integers), "
                         f"got {v!r}")
    if v.strip() and v.strip() not in LAYER_WORDS:
        parse_ids(v, f"{where}: {flag(name)}")


def sections(cls: type) -> dict[str, type]:
    """{field: section class} of a config class's section fields (a field whose type is a dataclass)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)
            if isinstance(hints[f.name], type) and dataclasses.is_dataclass(hints[f.name])}


def flat_names(cls: type) -> dict[str, str]:
    """{field name: its section} of every field of a `FLAT` section of `cls` (names spelled as the stage's own)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    return {g.name: name for name, sec in sections(cls).items() if fields[name].metadata.get("flat")
            for g in dataclasses.fields(sec) if g.init}


def from_flags(cls: type, **values: Any) -> Any:
    """`cls` from its flags' names: a `FLAT` section's fields by their own names (`lr=3e-3` into `hyper`), each
    section over its field's default; a section may also be given whole (`hyper=HyperParams(...)`). TypeError naming
    an unknown name, as a dataclass's constructor does."""
    flat, secs = flat_names(cls), sections(cls)
    top: dict[str, Any] = {}
    sub: dict[str, dict[str, Any]] = {}
    for k, v in values.items():
        if k in flat:
            sub.setdefault(flat[k], {})[k] = v
        else:
            top[k] = v
    for name, kw in sub.items():
        base = top.get(name)
        if base is None:
            f = cls.__dataclass_fields__[name]
            base = f.default_factory() if f.default_factory is not dataclasses.MISSING else secs[name]()
        top[name] = dataclasses.replace(base, **kw)
    return cls(**top)


def flag_values(cfg: Any) -> dict[str, Any]:
    """{flag name: value} of a config: a `FLAT` section's fields by their own names, another section as a dict (what
    a flat record, e.g. trainer_state.json's "config", holds)."""
    out: dict[str, Any] = {}
    secs = sections(type(cfg))
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if f.name in secs and f.metadata.get("flat"):
            out.update(flag_values(v))
        else:
            out[f.name] = dataclasses.asdict(v) if f.name in secs else v
    return out


def lookup(cfg: Any, name: str) -> Any:
    """The value of field `name` of a config or of one of its `FLAT` sections (None when neither has it)."""
    sec = flat_names(type(cfg)).get(name)
    return getattr(getattr(cfg, sec), name) if sec else getattr(cfg, name, None)
