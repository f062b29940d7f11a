"""Layer-id conventions: the single source of truth for "which hidden state is layer i".

hstap's canonical id `i` (0-based) names the **output of decoder layer i**, i.e. the residual stream after layer i has
added its attention and MLP outputs. The "final" state is the output of the final norm (what `lm_head` consumes); it is
stored separately and never named by a layer id.

Each engine speaks its own dialect; converting is where silent off-by-ones come from, so every conversion lives here:

| convention | id j means | canonical i |
|---|---|---|
| hstap canonical | output of layer i | i |
| HF `output_hidden_states[j]` | j=0 embeddings, j in 1..N-1 output of layer j-1, **j=N post-norm** | j-1 (j < N) |
| SGLang draft config `eagle_aux_hidden_state_layer_ids` (Llama, Qwen, ...) | output of layer j; SGLang captures the input of layer j+1 | j |
| SGLang draft config, DeepSeek family | +1 applied only when the first id is 1; otherwise j is the input of layer j | j or j-1 |
| vLLM `extract_hidden_states` / speculators | input to layer j (= output of layer j-1); j = N is the last layer's pre-norm output | j-1 |

Example: Kimi-K2.5 and DeepSeek-V3 (N=61), EAGLE-3's default taps: canonical [1, 29, 57] = SGLang draft-config ids
[1, 29, 57] (DeepSeek's +1 rule fires on the leading 1: SGLang captures the inputs of layers [2, 30, 58]) = vLLM ids
[2, 30, 58] = HF `hidden_states[2, 30, 58]`. docs/engines.md has the same table.
"""

from __future__ import annotations

from collections.abc import Sequence

from hstap.common import HstapError

DEEPSEEK_MODEL_TYPES = frozenset({"deepseek_v2", "deepseek_v3", "kimi_k2", "deepseek_v32"})  # MLA targets

EMBEDDINGS = -1  # pseudo-id of the embedding output (the input of layer 0) among a recomputation's reference states


def parse_ids(spec: str | Sequence[int], what: str = "--layers") -> list[int]:
    """`"1,3,4"` (or a sequence) -> [1, 3, 4]; the one parser of comma-separated layer ids (`what` names the option).
    An empty item (`1,,3`, a trailing comma) is an error, not a skipped id."""
    if isinstance(spec, str):
        items = spec.split(",") if spec.strip() else []
        if any(not x.strip() for x in items):
            raise HstapError(f"{what}: an empty item in {spec!r} (expected comma-separated integers, e.g. 1,3,4)")
        try:
            return [int(x) for x in items]
        except ValueError:
            raise HstapError(f"{what}: expected comma-separated integers, got {spec!r}") from None
    return [int(x) for x in spec]


def fc_slots(aux_layers: Sequence[int]) -> int:
    """States the drafter's fc fuses: one per aux layer, or the final state alone when there is none (EAGLE-1-style)."""
    return max(1, len(aux_layers))


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's default low/mid/high taps for an N-layer target: outputs of layers [1, N//2-1, N-4] (vLLM's and
    SGLang's own defaults when a drafter names none). Below 7 layers those collide ([1, 2, 2] for N=6): 5 and 6 layers
    take [1, N//2, N-2] ([1, 3, 4] for N=6), distinct and below the last layer, whose output SGLang cannot capture;
    fewer layers have no three such taps that every engine takes."""
    if num_layers >= 7:
        return [1, num_layers // 2 - 1, num_layers - 4]
    if num_layers >= 5:
        return [1, num_layers // 2, num_layers - 2]
    raise HstapError(f"a {num_layers}-layer target has no default aux layers (three distinct taps below its last layer "
                     "need >= 5 layers): pass --layers, e.g. --layers "
                     f"{','.join(str(i) for i in range(max(1, num_layers - 1)))}")


def parse_layers(spec: str | Sequence[int] | None, num_layers: int, what: str = "--layers") -> list[int]:
    """Parse `--layers 1,3,4` (or a list) into validated canonical ids; None/"" means the default (`what` names the
    option in an error)."""
    if spec is None or spec == "" or spec == "default":
        return default_aux_layers(num_layers)
    ids = parse_ids(spec, what)
    check_layers(ids, num_layers, what)
    return ids


def check_layers(ids: Sequence[int], num_layers: int, what: str = "--layers") -> None:
    if not ids:
        raise HstapError(f"{what}: at least one layer id is needed")
    for i in ids:
        if not 0 <= i < num_layers:
            raise HstapError(f"{what}: layer id {i} is out of range for a {num_layers}-layer target (valid: 0..{num_layers - 1})")
    if list(ids) != sorted(set(ids)):
        raise HstapError(f"{what}: ids must be strictly increasing, got {list(ids)}")


def last_layer(num_layers: int) -> int:
    """Canonical id of the last decoder layer: its output is the pre-norm state the final norm turns into `final`."""
    return num_layers - 1


def to_hf_index(i: int, num_layers: int) -> int:
    """Canonical id -> index into HF `output_hidden_states` (only for i < N-1: HF's index N is post-norm)."""
    if not 0 <= i < num_layers - 1:
        raise HstapError(f"canonical layer {i} has no HF hidden_states index in a {num_layers}-layer model "
                         f"(hidden_states[{num_layers}] is taken after the final norm)")
    return i + 1


def from_hf_index(j: int, num_layers: int) -> int:
    if not 1 <= j < num_layers:
        raise HstapError(f"HF hidden_states index {j} is not the output of a decoder layer (valid: 1..{num_layers - 1})")
    return j - 1


def is_deepseek(model_type: str) -> bool:
    return model_type in DEEPSEEK_MODEL_TYPES


def to_sglang(ids: Sequence[int], model_type: str = "llama") -> list[int]:
    """Canonical ids -> the `eagle_aux_hidden_state_layer_ids` to write into an SGLang draft config.

    Llama-family models capture the input of layer id+1 for every id. DeepSeek models add +1 only when the first id is 1
    (SGLang PR #25454), otherwise they take the ids as layer inputs; we write whichever form resolves to our layers.
    """
    ids = [int(i) for i in ids]
    if not is_deepseek(model_type) or ids[0] == 1:
        return ids
    raw = [i + 1 for i in ids]  # DeepSeek without the +1 rule: the ids are layer inputs
    if raw[0] == 1:
        raise HstapError(f"canonical layers {ids} cannot be expressed for SGLang's DeepSeek loader "
                         "(input-of-layer-1 ids would trigger its +1 rule)")
    return raw


def sglang_capture_inputs(config_ids: Sequence[int], model_type: str = "llama") -> list[int]:
    """Which layer *inputs* SGLang captures for the given draft-config ids (what `layers_to_capture` ends up holding)."""
    config_ids = [int(i) for i in config_ids]
    if is_deepseek(model_type) and config_ids[0] != 1:
        return config_ids
    return [i + 1 for i in config_ids]


def layer_inputs(ids: Sequence[int]) -> list[int]:
    """The decoder-layer inputs that hold canonical ids' states: the input of layer i + 1 is the output of layer i."""
    return [int(i) + 1 for i in ids]


def sglang_id_forms(ids: Sequence[int], model_type: str = "llama") -> list[list[int]]:
    """The SGLang id lists that may capture canonical `ids`, most likely first: the model type's form (`to_sglang`),
    then the ids as canonical (the Llama form) and as layer inputs (the DeepSeek form without its +1). A server reads
    back which one its model class takes (an SGLang class may follow DeepSeek's rule under a model type not listed)."""
    out: list[list[int]] = []
    try:
        out.append(to_sglang(ids, model_type))
    except HstapError:  # a form the model type's rule cannot express; the others are still tried
        pass
    for form in ([int(i) for i in ids], layer_inputs(ids)):
        if form not in out:
            out.append(form)
    return out


def check_sglang_capturable(ids: Sequence[int], num_layers: int, what: str = "--layers") -> None:
    """Refuse canonical ids SGLang cannot capture: the last layer's output (N-1). SGLang captures layer *inputs*:
    `set_eagle3_layers_to_capture` stores `id + 1` (sglang 0.5.23 srt/models/llama.py:941; DeepSeek likewise) and the
    model's forward captures `i in range(start_layer, end_layer)` (llama.py:486-492), so input N, the output of layer
    N-1, is never taken. The last layer's output after the final norm is always stored as `final`."""
    last = last_layer(num_layers)
    if last in [int(i) for i in ids]:
        raise HstapError(f"{what}: SGLang cannot capture canonical layer {last}, the last layer's output, in a "
                         f"{num_layers}-layer target (it captures layer inputs: id+1 = {num_layers} is not a layer; "
                         f"the final-norm output is stored as `final` anyway): use ids up to {last - 1}")


def from_sglang(config_ids: Sequence[int], model_type: str = "llama") -> list[int]:
    """SGLang draft-config ids -> canonical ids."""
    return [i - 1 for i in sglang_capture_inputs(config_ids, model_type)]


def sglang_default_capture_inputs(num_layers: int) -> list[int]:
    """The layer inputs SGLang captures when the draft config names no ids: [2, N//2, N-3], used as-is."""
    return [2, num_layers // 2, num_layers - 3]


def vllm_default_ids(num_layers: int) -> list[int]:
    """The ids vLLM taps when a drafter config names none: (2, N//2, N-3), read as layer inputs."""
    return [2, num_layers // 2, num_layers - 3]


def to_vllm(ids: Sequence[int]) -> list[int]:
    """Canonical ids -> vLLM / speculators `eagle_aux_hidden_state_layer_ids` ("input to layer j")."""
    return [int(i) + 1 for i in ids]


def from_vllm(ids: Sequence[int], num_layers: int | None = None) -> list[int]:
    """vLLM ids -> canonical ids; j = N (the last layer's pre-norm output) maps to canonical N-1. Without num_layers
    (a drafter config that does not name its target's depth) only j >= 1 is checked."""
    out = []
    for j in ids:
        if j < 1 or (num_layers is not None and j > num_layers):
            raise HstapError(f"vLLM layer id {j} is out of range for a {num_layers}-layer target (valid: 1..{num_layers})")
        out.append(int(j) - 1)
    return out


def parse_vllm_layers(spec: str | Sequence[int] | None, num_layers: int) -> tuple[list[int], list[int]]:
    """`--vllm-layers 2,4,5,8` -> (vLLM ids, canonical aux ids). The last id must be N: vLLM's slot for the last layer's
    pre-norm output, from which the final state is computed."""
    if spec is None or spec == "" or spec == []:
        raise HstapError("--vllm-layers: required with --engine vllm-import: the eagle_aux_hidden_state_layer_ids "
                         f"the vLLM server was launched with, ending with {num_layers} "
                         f"(e.g. 2,{num_layers // 2},{num_layers - 3},{num_layers})")
    ids = parse_ids(spec, "--vllm-layers")
    if len(ids) < 2 or ids[-1] != num_layers:
        raise HstapError(f"--vllm-layers {spec}: the last id must be {num_layers} (the last layer's pre-norm output, "
                         f"from which `final` is computed) and at least one aux id must precede it")
    canonical = from_vllm(ids[:-1], num_layers)
    check_layers(canonical, num_layers)
    if last_layer(num_layers) in canonical:
        raise HstapError(f"--vllm-layers {spec}: id {num_layers} appears twice")
    return ids, canonical


def reference_ids(num_layers: int) -> list[int]:
    """The states a recomputation compares stored slots against, in order: EMBEDDINGS (-1), the outputs of layers
    0..N-1 (pre-norm) and N = the final-norm output (what `final` must be)."""
    return list(range(EMBEDDINGS, num_layers + 1))


def reference_index(i: int) -> int:
    """Position of id `i` (EMBEDDINGS, a canonical layer id, or N for the final-norm output) in `reference_ids`."""
    return i - EMBEDDINGS
