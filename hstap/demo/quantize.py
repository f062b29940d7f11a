"""Quantized copies of a target, in the formats quantized models ship in: what users download and serve.

- INT4 W4A16, compressed-tensors' `pack-quantized` format (`quant_method: compressed-tensors`; Kimi-K2's and Kimi-K2.5's
  experts): per Linear `weight_packed` (int32, eight 4-bit values each), `weight_scale` (one per group of `group_size`
  input columns, in the weight's dtype) and `weight_shape`; symmetric, round-to-nearest. The numbers are
  compressed-tensors' own (`calculate_qparams`, `PackedQuantizationCompressor.compress`), the config its
  `QuantizationConfig`, the one vLLM and transformers read.
- FP8 with block scales, DeepSeek-V3's `quant_method: fp8` (`weight_block_size` [128, 128], `activation_scheme:
  dynamic`): per Linear `weight` (float8_e4m3fn) and `weight_scale_inv` (fp32, one per 128 x 128 block, the factor the
  fp8 values are multiplied by), the block scale compressed-tensors' rule for an fp8 e4m3 range (amax / 448).

What is quantized is what the shipped checkpoints quantize: the decoder's Linear weights (2-D `*.weight` tensors), never
the embedding, the lm_head, a MoE router (`mlp.gate`, a plain matrix in every engine) or a multimodal wrapper's vision
tower; `ignore` (compressed-tensors' patterns: a module name, or "re:" + a regex) leaves out more. `KIMI_INT4_IGNORE` is
Kimi-K2's: only the routed experts are INT4.

    from hstap.demo.quantize import quantize_int4, quantize_fp8, KIMI_INT4_IGNORE
    quantize_int4("target", "target-int4", group_size=128)        # -> {"format", "quantized", "kept", ...}
    quantize_fp8("target", "target-fp8")

`dequantized_weights(path)` reads a quantized checkpoint back as the plain weights it stands for (compressed-tensors'
own decompression, DeepSeek's fp8 x scale): the quantized model as a full-precision checkpoint, for checks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from hstap.artifacts.model_dir import check_model_dir, tensor_files
from hstap.common import HstapError, publishing_dir

# Kimi-K2's and Kimi-K2.5's quantization_config: INT4 W4A16, group 32, only the routed experts
KIMI_INT4_IGNORE = ("lm_head", r"re:.*self_attn.*", r"re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*")
FP8_MAX = 448.0  # largest float8_e4m3fn
NEVER_QUANTIZED = ("embed_tokens.weight", "lm_head.weight", ".mlp.gate.weight")  # name suffixes
WRAPPER_PARTS = ("vision_tower.", "mm_projector.")  # a multimodal wrapper's other towers: left as they are


def quantizable(name: str, tensor: torch.Tensor, ignore=()) -> bool:
    """Whether `name` is a Linear weight the shipped formats quantize: a 2-D `*.weight` of the decoder that no `ignore`
    pattern (on its module name) and no NEVER_QUANTIZED suffix leaves out."""
    from compressed_tensors.utils.match import match_name

    if tensor.dim() != 2 or not name.endswith(".weight") or name.endswith(NEVER_QUANTIZED):
        return False
    if any(name.startswith(p) or ("." + p) in name for p in WRAPPER_PARTS):
        return False
    module = name[: -len(".weight")]
    return not any(match_name(module, p) or match_name(module.split("language_model.", 1)[-1], p) for p in ignore)


def int4_config(group_size: int, ignore=("lm_head",)) -> dict:
    """The `quantization_config` of an INT4 W4A16 pack-quantized checkpoint, as compressed-tensors writes it."""
    from compressed_tensors import __version__
    from compressed_tensors.quantization import QuantizationConfig

    qc = QuantizationConfig(config_groups={"group_0": _int4_scheme(group_size)}, ignore=list(ignore),
                            format="pack-quantized", quantization_status="compressed")
    return {**qc.model_dump(mode="json"), "version": __version__}


def fp8_config(block: tuple[int, int] = (128, 128)) -> dict:
    """DeepSeek-V3's `quantization_config`."""
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(block)}


def _int4_scheme(group_size: int):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)
    return QuantizationScheme(targets=["Linear"], weights=args, format="pack-quantized")


def int4_tensors(name: str, w: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """One Linear weight (O, I) as pack-quantized tensors: `weight_packed` (O, I/8) int32, `weight_scale` (O, I/group)
    in w's dtype, `weight_shape` (2,). The groups' scales are rounded to w's dtype before the values are quantized with
    them, so the stored scales are the ones the values were rounded with."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    out_f, in_f = w.shape
    if in_f % group_size:
        raise HstapError(f"{name}: {in_f} input columns are not a multiple of the group size {group_size}")
    scheme = _int4_scheme(group_size)
    x = w.float()  # (O, I)
    g = x.reshape(out_f, in_f // group_size, group_size)  # (O, G, group)
    scale, _ = calculate_qparams(g.amin(-1), g.amax(-1), scheme.weights)  # (O, G)
    scale = scale.to(w.dtype)
    packed = PackedQuantizationCompressor.compress({"weight": x, "weight_scale": scale.float()}, scheme)
    base = name[: -len("weight")]
    return {base + "weight_packed": packed["weight_packed"].contiguous(), base + "weight_scale": scale.contiguous(),
            base + "weight_shape": packed["weight_shape"]}


def fp8_tensors(name: str, w: torch.Tensor, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """One Linear weight (O, I) in DeepSeek-V3's fp8: `weight` (O, I) float8_e4m3fn and `weight_scale_inv`
    (ceil(O/bo), ceil(I/bi)) fp32, a block's scale its largest |w| over the fp8 range (compressed-tensors'
    `calculate_qparams`); edge blocks are partial, as DeepSeek's."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.utils import calculate_qparams

    bo, bi = block
    out_f, in_f = w.shape
    x = w.float()  # (O, I)
    po, pi = -out_f % bo, -in_f % bi
    blocks = torch.nn.functional.pad(x.abs(), (0, pi, 0, po)).reshape((out_f + po) // bo, bo, (in_f + pi) // bi, bi)
    amax = blocks.amax(dim=(1, 3))  # (O/bo, I/bi)
    args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=list(block))
    scale, _ = calculate_qparams(-amax, amax, args)  # (O/bo, I/bi)
    scale = scale.float()
    full = scale.repeat_interleave(bo, 0).repeat_interleave(bi, 1)[:out_f, :in_f]  # (O, I)
    q = (x / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {name: q, name[: -len("weight")] + "weight_scale_inv": scale.contiguous()}


def quantize_int4(src, out, *, group_size: int = 128, ignore=("lm_head",), existing: str = "refuse") -> dict:
    """Write an INT4 W4A16 pack-quantized copy of the HF model directory `src` at `out` (compressed-tensors' format and
    config; group `group_size`, symmetric, round-to-nearest). Returns what was done: {"format", "quantized" (tensor
    names), "kept"}."""
    return _rewrite(src, out, int4_config(group_size, ignore), ignore,
                    lambda n, w: int4_tensors(n, w, group_size), existing)


def quantize_fp8(src, out, *, block: tuple[int, int] = (128, 128), ignore=("lm_head",), existing: str = "refuse") -> dict:
    """Write DeepSeek-V3's block-FP8 copy of `src` at `out` (`quant_method: fp8`, `weight_block_size` `block`)."""
    return _rewrite(src, out, fp8_config(tuple(block)), ignore, lambda n, w: fp8_tensors(n, w, tuple(block)), existing)


def _rewrite(src, out, qconfig: dict, ignore, convert, existing: str) -> dict:
    """`src`'s directory at `out`, its quantizable weights through `convert`, shard by shard (one output file per input
    file, the index rewritten), `qconfig` as config.json's `quantization_config`; published whole."""
    from safetensors.torch import load_file, save_file

    src, out = check_model_dir(src), Path(out)
    conf = json.loads((src / "config.json").read_text())
    if "quantization_config" in conf:
        raise HstapError(f"{src / 'config.json'}: already quantized ({conf['quantization_config'].get('quant_method')})")
    index_file, files = tensor_files(src)
    done: dict = {"format": qconfig.get("format", qconfig["quant_method"]), "quantized": [], "kept": []}
    weight_map = {}
    with publishing_dir(out, existing) as tmp:
        for f in sorted(set(files.values())):
            state = {}
            for name, t in load_file(str(f)).items():
                if quantizable(name, t, ignore):
                    state.update(convert(name, t))
                    done["quantized"].append(name)
                else:
                    state[name] = t
                    done["kept"].append(name)
            save_file(state, str(tmp / f.name), metadata={"format": "pt"})
            weight_map.update({k: f.name for k in state})
        if index_file.name.endswith(".index.json"):
            index = json.loads(index_file.read_text())
            index["weight_map"] = dict(sorted(weight_map.items()))
            (tmp / index_file.name).write_text(json.dumps(index, indent=2) + "\n")
        for extra in src.iterdir():  # tokenizer, chat template, generation config: as they are
            if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in ("config.json", index_file.name):
                shutil.copy2(extra, tmp / extra.name)
        conf["quantization_config"] = qconfig
        (tmp / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
    if not done["quantized"]:
        raise HstapError(f"{src}: no Linear weight left to quantize (ignore {list(ignore)})")
    return done


def dequantized_weights(path) -> dict[str, torch.Tensor]:
    """The plain fp32 weights a quantized checkpoint written here stands for, by their plain names: pack-quantized
    groups unpacked by compressed-tensors (`PackedQuantizationCompressor.decompress`), fp8 blocks times their
    `weight_scale_inv`; every other tensor as stored (in fp32)."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from safetensors.torch import load_file

    p = check_model_dir(path)
    qc = json.loads((p / "config.json").read_text()).get("quantization_config") or {}
    _, files = tensor_files(p)
    state = {}
    for f in sorted(set(files.values())):
        state.update(load_file(str(f)))
    out = {}
    for name in sorted(state):
        base = name.rsplit(".", 1)[0] + "."
        if name.endswith(".weight_packed"):
            group = next(iter(qc["config_groups"].values()))["weights"]["group_size"]
            parts = {k: state[base + k].float() if k == "weight_scale" else state[base + k]
                     for k in ("weight_packed", "weight_scale", "weight_shape")}
            out[base + "weight"] = PackedQuantizationCompressor.decompress(parts, _int4_scheme(group))["weight"].float()
        elif name.endswith(".weight") and base + "weight_scale_inv" in state:
            bo, bi = qc["weight_block_size"]
            s = state[base + "weight_scale_inv"]
            full = s.repeat_interleave(bo, 0).repeat_interleave(bi, 1)[: state[name].shape[0], : state[name].shape[1]]
            out[name] = state[name].float() * full
        elif not name.endswith((".weight_scale", ".weight_shape", ".weight_scale_inv")):
            out[name] = state[name].float()
    return out
