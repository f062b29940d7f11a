"""Layer-id conventions: every conversion against real cases (Kimi-K2.5 / DeepSeek-V3 N=61, Llama N=32, the tiny N=8),
and a scan that keeps layer-id arithmetic (`+ 1` / `- 1` on layer ids or counts) inside hstap/layers.py."""

import ast
import re
import subprocess
from pathlib import Path

import pytest
import torch

from hstap import layers as L
from hstap.common import HstapError

ROOT = Path(__file__).resolve().parent.parent


def test_kimi_k25_vector():
    # DeepSeek-V3 architecture, N=61, H=7168. The default taps (docs/engines.md's table): canonical [1, 29, 57] = SGLang
    # ids [1, 29, 57] (the +1 rule fires: inputs of [2, 30, 58]) = vLLM ids [2, 30, 58] = HF hidden_states[2, 30, 58].
    assert L.default_aux_layers(61) == [1, 29, 57] == L.to_sglang([1, 29, 57], "kimi_k2")
    assert L.to_vllm([1, 29, 57]) == [2, 30, 58] == [L.to_hf_index(i, 61) for i in (1, 29, 57)]
    # Other taps: canonical outputs [2, 30, 58] = SGLang captures inputs of [3, 31, 59] = vLLM ids [3, 31, 59].
    canon = [2, 30, 58]
    assert L.to_vllm(canon) == [3, 31, 59]
    assert L.from_vllm([3, 31, 59], 61) == canon
    cfg_ids = L.to_sglang(canon, "deepseek_v3")
    assert cfg_ids == [3, 31, 59]  # first id != 1: DeepSeek takes them as layer inputs, no +1
    assert L.sglang_capture_inputs(cfg_ids, "deepseek_v3") == [3, 31, 59]
    assert L.from_sglang(cfg_ids, "deepseek_v3") == canon
    # The same layers written in the "safe" form that starts at 1 resolve identically on both families.
    assert L.sglang_capture_inputs([1, 29, 57], "deepseek_v3") == [2, 30, 58]
    assert L.sglang_capture_inputs([1, 29, 57], "llama") == [2, 30, 58]


@pytest.mark.parametrize("n,expected", [(8, [1, 3, 4]), (32, [1, 15, 28]), (61, [1, 29, 57])])
def test_default_aux_layers(n, expected):
    assert L.default_aux_layers(n) == expected
    # SGLang's id-less default ([2, N//2, N-3] as layer inputs) is the same three layers.
    assert [i - 1 for i in L.sglang_default_capture_inputs(n)] == expected
    # Llama-family SGLang config ids are canonical ids; DeepSeek's +1 rule fires because the first id is 1.
    assert L.to_sglang(expected, "llama") == expected
    assert L.to_sglang(expected, "deepseek_v3") == expected
    assert L.from_sglang(expected, "llama") == expected == L.from_sglang(expected, "deepseek_v3")
    assert L.from_vllm(L.to_vllm(expected), n) == expected


def test_small_targets_get_a_default_that_works_or_one_named():
    # [1, N//2-1, N-4] collides below 7 layers ([1, 2, 2] for N=6): 5 and 6 layers take [1, N//2, N-2]
    assert L.default_aux_layers(7) == [1, 2, 3]
    assert L.default_aux_layers(6) == [1, 3, 4] == L.parse_layers("", 6) and L.default_aux_layers(5) == [1, 2, 3]
    for n in (5, 6):
        ids = L.default_aux_layers(n)
        L.check_layers(ids, n)
        L.check_sglang_capturable(ids, n)  # never the last layer, whose output SGLang cannot capture
        for family in ("llama", "deepseek_v3", "kimi_k2"):
            assert L.from_sglang(L.to_sglang(ids, family), family) == ids
        assert L.from_vllm(L.to_vllm(ids), n) == ids
    with pytest.raises(HstapError, match=r"a 4-layer target has no default aux layers .*: pass --layers, e\.g\. "
                                         r"--layers 0,1,2$"):
        L.default_aux_layers(4)
    assert L.parse_layers("0,1,2", 4) == [0, 1, 2]  # the one named is accepted
    with pytest.raises(HstapError, match="--layers 0$"):
        L.default_aux_layers(2)


def test_vllm_last_layer_is_pre_norm_output():
    # vLLM id N = the last layer's pre-norm output = canonical N-1, which HF does not expose (its index N is post-norm).
    assert L.from_vllm([32], 32) == [31]
    with pytest.raises(HstapError, match="after the final norm"):
        L.to_hf_index(31, 32)
    assert L.to_hf_index(30, 32) == 31 and L.from_hf_index(31, 32) == 30
    with pytest.raises(HstapError):
        L.from_vllm([33], 32)


def test_llama_sglang_shift_and_deepseek_edge():
    assert L.sglang_capture_inputs([2, 30, 58], "llama") == [3, 31, 59]
    # canonical 0 = input of layer 1, but an id list starting with 1 triggers DeepSeek's +1 rule.
    with pytest.raises(HstapError, match="cannot be expressed"):
        L.to_sglang([0, 3], "deepseek_v3")


def test_parse_and_check_layers():
    assert L.parse_layers("1,3,4", 8) == [1, 3, 4]
    assert L.parse_layers("", 8) == [1, 3, 4]
    for bad, msg in [("1,8", "out of range"), ("3,1", "strictly increasing"), ("a,b", "integers"), ("1,1", "strictly")]:
        with pytest.raises(HstapError, match=msg):
            L.parse_layers(bad, 8)


def test_hf_index_matches_hidden_states(tiny_llama):
    from transformers import AutoModelForCausalLM

    from hstap.models.target import Target

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    N = model.config.num_hidden_layers
    ids = torch.randint(6, 300, (1, 9))
    hs = model(ids, output_hidden_states=True).hidden_states
    aux, final, _ = Target(model).capture(ids, list(range(N)))
    for i in range(N - 1):
        torch.testing.assert_close(aux[:, :, i], hs[L.to_hf_index(i, N)], rtol=0, atol=0)
    # HF's last entry is the final-norm output, not layer N-1's raw output.
    torch.testing.assert_close(final, hs[N], rtol=0, atol=0)
    assert not torch.allclose(aux[:, :, N - 1], hs[N])


def test_fc_slots_and_reference_ids():
    assert L.fc_slots([1, 3, 4]) == 3
    assert L.fc_slots([]) == 1  # EAGLE-1 style: the final state alone
    refs = L.reference_ids(8)
    assert refs[0] == L.EMBEDDINGS and refs[-1] == 8 and len(refs) == 8 + 2
    assert all(refs[L.reference_index(i)] == i for i in refs)
    assert L.last_layer(8) == 7 == L.from_vllm([8], 8)[0]


# --- no layer arithmetic outside layers.py ----------------------------------------------------------------------------
# An AST scan for `x + 1` / `x - 1` (and `x += 1`) where x is a layer id or a layer count: a name such as `layer` or
# `last_layer`, an element of an id list (`claimed[k]`, `aux_layers[0]`, a loop or comprehension variable over `ids`,
# `layers`, `config_ids`, ...; `int(...)` of any of these) or a layer count (`num_layers`, `cfg.num_hidden_layers`, or
# a local assigned from one, like `N = target.num_layers`). Slot counts (`len(layers) + 1`), token positions and
# lengths are other quantities and are not flagged.

ID_LISTS = re.compile(r"(^|_)(layers|ids|claimed|captured)$")  # containers of layer ids: aux_layers, config_ids, ...
ID_NAMES = re.compile(r"(^|_)layer(_id|_idx)?$")  # one layer id: layer, last_layer, layer_id
COUNTS = re.compile(r"^(num_layers|n_layers|num_hidden_layers)$")  # a layer count N: N-1 is the last layer, N+1 a bound
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _is_list(node) -> bool:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args \
            and node.func.id in ("list", "sorted", "reversed"):
        node = node.args[0]  # list(ids) iterates over the same ids
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    return name is not None and bool(ID_LISTS.search(name))


def _is_count(node, counts: set) -> bool:
    if isinstance(node, ast.Name):
        return node.id in counts or bool(COUNTS.match(node.id))
    return isinstance(node, ast.Attribute) and bool(COUNTS.match(node.attr))


def _own_nodes(scope):
    """The nodes of a function (or module) outside its nested functions."""
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, SCOPES):
            todo.extend(ast.iter_child_nodes(node))


class _Scan(ast.NodeVisitor):
    """Walks a module keeping the names bound to one layer id (loop variables over id lists, in their loop) and to a
    layer count (assigned from num_layers & co., in their function)."""

    def __init__(self):
        self.ids: set = set()
        self.counts: set = set()
        self.hits: set = set()

    def _counts_of(self, scope) -> set:
        counts = set(self.counts)
        for node in _own_nodes(scope):
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                t, v = node.targets[0], node.value
                tuples = isinstance(t, ast.Tuple) and isinstance(v, ast.Tuple) and len(t.elts) == len(v.elts)
                for a, b in zip(t.elts, v.elts) if tuples else [(t, v)]:
                    if isinstance(a, ast.Name) and _is_count(b, counts):
                        counts.add(a.id)
        return counts

    def _within(self, node, ids: set, counts: set) -> None:
        saved = self.ids, self.counts
        self.ids, self.counts = ids, counts
        self.generic_visit(node)
        self.ids, self.counts = saved

    def visit_Module(self, node):
        self._within(node, set(), self._counts_of(node))

    def visit_FunctionDef(self, node):
        self._within(node, self.ids, self._counts_of(node))

    visit_AsyncFunctionDef = visit_Lambda = visit_FunctionDef

    def _loop(self, node, generators):
        bound = {g.target.id for g in generators if isinstance(g.target, ast.Name) and _is_list(g.iter)}
        self._within(node, self.ids | bound, self.counts)

    def visit_For(self, node):
        self._loop(node, [node])

    def visit_ListComp(self, node):
        self._loop(node, node.generators)

    visit_SetComp = visit_GeneratorExp = visit_DictComp = visit_ListComp

    def _layerish(self, node) -> bool:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "int" and node.args:
            node = node.args[0]
        if isinstance(node, ast.Name) and (node.id in self.ids or ID_NAMES.search(node.id)):
            return True
        if isinstance(node, ast.Subscript) and not isinstance(node.slice, ast.Slice):
            return _is_list(node.value)
        return _is_count(node, self.counts)

    def _check(self, node, operand, other) -> None:
        one = isinstance(other, ast.Constant) and type(other.value) is int and other.value == 1
        if one and self._layerish(operand):
            self.hits.add((node.lineno, ast.unparse(node)))

    def visit_BinOp(self, node):
        if isinstance(node.op, (ast.Add, ast.Sub)):
            self._check(node, node.left, node.right)
            self._check(node, node.right, node.left)
        self.generic_visit(node)

    def visit_AugAssign(self, node):
        if isinstance(node.op, (ast.Add, ast.Sub)):
            self._check(node, node.target, node.value)
        self.generic_visit(node)


def layer_arithmetic(source: str) -> list[tuple[int, str]]:
    """(line, expression) of every `+ 1` / `- 1` applied to a layer id or a layer count in `source`."""
    scan = _Scan()
    scan.visit(ast.parse(source))
    return sorted(scan.hits)


def test_no_layer_arithmetic_outside_layers_py():
    hits = [f"{f.relative_to(ROOT)}:{line}: {expr}" for f in sorted((ROOT / "hstap").rglob("*.py"))
            if f != ROOT / "hstap" / "layers.py" for line, expr in layer_arithmetic(f.read_text())]
    assert not hits, "layer-id arithmetic outside hstap/layers.py (use its conversions): " + "; ".join(hits)


# Verbatim excerpts of the code this scan was written against (before layers.py had reference_ids, from_vllm, ...).
OLD_VERIFY = """
def recompute(store_path, target_dir, samples=4, device="cpu", compute_dtype="auto", max_tokens=1024, target=None):
    s = open_store(store_path)
    N, H = target.num_layers, target.hidden_size
    K = len(s.layers)
    cand = list(range(-1, N + 1))  # -1 embeddings, 0..N-1 layer outputs (pre-norm), N final-norm output
    claimed = list(s.layers) + [N]  # stored aux slots, then `final`
    acc: list[dict | None] = [None] * (K + 1)
    for k in range(K + 1):
        acc[k] = _merge(acc[k], layer_stats(stored[:, k], refs[:, claimed[k] + 1], ulps=s.dtype != "fp8"))
    for k in range(K + 1):
        if k == K:
            if best_ok and bj == N - 1:
                msg = "final matches pre-norm output of the last layer: missing final norm"
"""
OLD_EXPORT = """
def load_exported(path, embed_weight=None, device="cpu", dtype=torch.float32):
    if conf.get("speculators_model_type") == "eagle3":
        ids = conf.get("eagle_aux_hidden_state_layer_ids") or []
        mtype = info.get("target_model_type", "llama")
        aux = info.get("aux_layers", [int(j) - 1 for j in ids])
"""
OLD_VLLM = """
def parse_vllm_layers(spec, num_layers):
    canonical = from_vllm(ids[:-1], num_layers)
    check_layers(canonical, num_layers)
    if num_layers - 1 in canonical:
        raise HstapError(f"--vllm-layers {spec}: id {num_layers} appears twice")
"""
# Unrelated `+ 1` / `- 1` from the same code base: positions, lengths, counters, slot and sample counts.
UNRELATED = """
def f(tree, out, pos, lens, cache, slots, sh, messages, last_user, layers, steps, ids, n_win, seq_len):
    L = len(ids)
    dev_pos = [[L - 1 + d for d in tree.depths]]
    stats = {"verify_tokens": len(out) - 1, "steps": steps + 1, "slots": len(layers) + 1}
    gaps = any(pos[i] + lens[i] != pos[i + 1] for i in range(len(pos) - 1))
    windows = ids[: n_win * seq_len + 1]
    T, N, K, H = sum(sh.lengths), len(sh.ids), sh.num_aux, sh.hidden_size
    offsets = torch.zeros(N + 1, dtype=torch.int64)
    for layer in cache.layers:
        n = layer.start + len(slots)
    return messages[:last_user + 1], ids[-1]
"""


def test_scan_flags_the_old_code_only():
    assert [e for _, e in layer_arithmetic(OLD_VERIFY)] == ["N + 1", "claimed[k] + 1", "N - 1"]
    assert [e for _, e in layer_arithmetic(OLD_EXPORT)] == ["int(j) - 1"]
    assert [e for _, e in layer_arithmetic(OLD_VLLM)] == ["num_layers - 1"]
    assert layer_arithmetic(UNRELATED) == []


OLD_COMMIT = "e0c5eaae39c26dabf5de594a811d377b0c323e33"  # the last commit before the layer-id renovation


@pytest.mark.parametrize("path,expected", [
    ("hstap/verify/stage.py", ["N + 1", "claimed[k] + 1", "N - 1"]), ("hstap/export.py", ["int(j) - 1"]),
    ("hstap/engines/vllm.py", ["num_layers - 1"])])
def test_scan_flags_the_old_files(path, expected):
    try:
        old = subprocess.run(["git", "-C", str(ROOT), "show", f"{OLD_COMMIT}:{path}"], check=False,
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        pytest.skip("git is not available")
    if old.returncode != 0:
        pytest.skip(f"{OLD_COMMIT[:7]} is not in this checkout's history")
    assert [e for _, e in layer_arithmetic(old.stdout)] == expected
