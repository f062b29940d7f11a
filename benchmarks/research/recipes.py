"""The drafter recipes that benchmarks/research/quality_variants.py trains, by name: train's defaults (`base`) and
variants built on the recipe of train's earlier defaults (`OLD`), so that a name means the same training whatever
train's defaults become. Each name maps to (train flags, the store it trains on)."""

from __future__ import annotations

OLD = {"--lr": "2e-3", "--ttt": "7", "--ttt-decay": "0.8", "--loss": "ce"}
"""The recipe of train's earlier defaults (lr 2e-3, TTT 7, decay 0.8, soft CE: `defaults-before`): every variant but
base is built on it, so a name means the same training whatever train's defaults are."""


def old(*flags: str) -> list[str]:
    """OLD with `flags` ("--name", value pairs) changed or added -> train flags."""
    kv = {**OLD, **dict(zip(flags[::2], flags[1::2]))}
    return [x for pair in kv.items() for x in pair]


LR = ("--lr", "1e-3")  # lr 1e-3: the recipe of a 2.268 baseline, the reference of a ">= 1.08x" goal
R = ("--lr", "3e-3", "--ttt", "5")  # the best pair of a search at lr and TTT (R+... variants change one thing more)
HARD = ("--loss", "ce+hard", "--loss-mix", "0.5")
VARIANTS = {  # name -> (train flags, store); every variant but base is OLD with the changes its name says
    "base": ([], "store"),  # train's defaults (lr 3e-3, TTT 5, decay 0.6, ce+hard)
    "defaults-before": (old(), "store"),  # train's earlier defaults: "base" of the earlier tables
    "seed2": (old("--seed", "2"), "store"),  # defaults-before's other seed: how far two runs of one recipe differ
    "lr1e-4": (old("--lr", "1e-4"), "store"),  # the default lr before 2e-3
    "lr1e-3": (old(*LR), "store"),  # the recipe of the 2.268 baseline
    "lr3e-3": (old("--lr", "3e-3"), "store"),
    "cosine0": (old("--warmup-ratio", "0.015", "--min-lr-ratio", "0.0"), "store"),  # the schedule before the warmup 0.05 / floor 0.1 default
    "ce+tv": (old("--loss", "ce+tv", "--loss-mix", "0.5"), "store"),
    "tv": (old("--loss", "tv"), "store"),
    "lk": (old("--loss", "lk"), "store"),
    "ce+hard": (old(*HARD), "store"),
    "ce+rkl": (old("--loss", "ce+rkl", "--loss-mix", "0.5"), "store"),
    "decay0.6": (old("--ttt-decay", "0.6"), "store"),
    "decay1.0": (old("--ttt-decay", "1.0"), "store"),
    "ttt5": (old("--ttt", "5"), "store"),
    "vocab4096": (old("--draft-vocab", "4096"), "store"),  # no --vocab-map: the top 4096 of the store's counts
    "n2": (old("--draft-layers", "2"), "store"),
    "n3": (old("--draft-layers", "3"), "store"),
    "fp8": ([], "store-fp8"),  # base on the fp8 store: parity with base
    "fp8-lr1e-3": (old(*LR), "store-fp8"),
    "lr3e-3+ttt5": (old(*R), "store"),  # the two best one-layer changes of the first search together
    "lr3e-3+ttt5+seed2": (old(*R, "--seed", "2"), "store"),
    "lr4e-3+ttt5": (old("--lr", "4e-3", "--ttt", "5"), "store"),
    "lr3e-3+ttt4": (old("--lr", "3e-3", "--ttt", "4"), "store"),
    "lr3e-3+ttt5+decay0.9": (old(*R, "--ttt-decay", "0.9"), "store"),
    "ttt5+decay0.6": (old("--ttt", "5", "--ttt-decay", "0.6"), "store"),
    # around lr3e-3+ttt5 (R)
    "R+decay0.7": (old(*R, "--ttt-decay", "0.7"), "store"),
    "R+decay0.6": (old(*R, "--ttt-decay", "0.6"), "store"),
    "R+clip1": (old(*R, "--grad-clip", "1.0"), "store"),
    "R+hass": (old(*R, "--loss", "ce+topk", "--loss-mix", "0.5"), "store"),  # HASS's ce + top-10, times 0.5
    "R+hard": (old(*R, *HARD), "store"),
    "R+vocab4096": (old(*R, "--draft-vocab", "4096"), "store"),
    "R+seed2": (old(*R, "--seed", "2"), "store"),
    "R+hard+decay0.6": (old(*R, *HARD, "--ttt-decay", "0.6"), "store"),  # = base (train's defaults)
    "R+hard0.75": (old(*R, "--loss", "ce+hard", "--loss-mix", "0.75"), "store"),
    "R+hard+seed2": (old(*R, *HARD, "--seed", "2"), "store"),
    "lr3e-3+ttt6": (old("--lr", "3e-3", "--ttt", "6"), "store"),  # the tree decoder's default depth
    "lr3e-3+ttt6+decay0.7": (old("--lr", "3e-3", "--ttt", "6", "--ttt-decay", "0.7"), "store"),
    # the same training tokens over two answers per prompt: the greedy one and one sampled from the target (MIX)
    "mix": (old("--epochs", "1"), "store-mix"),
    "mix-lr3e-3+ttt5": (old("--epochs", "1", *R), "store-mix"),
}
