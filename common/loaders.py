"""Real inputs for ``moe-bwd run`` / ``moe-bwd compare``: router dumps and Hugging Face expert
weights (issue 9 item 4).

* :func:`load_routing` reads a router dump: a mapping with ``expert_index`` [T, K] (any integer
  dtype, -1 = dropped slot) and ``affinity`` [T, K] (floating) from a ``.pt`` file (read with
  ``torch.load(weights_only=True)``: no code runs), a ``.safetensors`` file or a ``.npz`` file
  (``allow_pickle=False``). Every rule is checked before any work and a violation is a
  ValueError naming the file and the rule.
* :func:`load_expert_weights` reads one MoE layer's routed experts from a Hugging Face
  safetensors shard and maps them to our layouts ``w_gate_up_EH2I [E, H, 2, I]`` (gate at index
  0, up at 1) and ``w_down_EIH [E, I, H]`` (plus ``b_gate_up_E2I [E, 2, I]`` and ``b_down_EH
  [E, H]`` for gpt-oss). A missing tensor or a wrong shape is a ValueError naming the file and
  the tensor.

Checkpoint layouts by family (``N`` layer, ``e`` expert; HF ``nn.Linear`` weights are
``[out, in]``, so ``gate_proj.weight`` is ``[I, H]`` and ``down_proj.weight`` ``[H, I]``):

=============  ====================================================================  =========
family         tensors under ``...layers.N.``                                        models
=============  ====================================================================  =========
qwen3_moe      ``mlp.experts.e.{gate_proj,up_proj,down_proj}.weight``                Qwen3-MoE,
                                                                                     OLMoE
mixtral        ``block_sparse_moe.experts.e.{w1,w3,w2}.weight`` (w1 gate, w3 up,      Mixtral
               w2 down)
deepseek_v3    ``mlp.experts.e.{gate_proj,up_proj,down_proj}.weight``; FP8 shards     DeepSeek-V3,
               (``weight_scale_inv``, 128x128 blocks) are dequantized                 Kimi-K2
llama4         ``feed_forward.experts.gate_up_proj`` [E, H, 2I] (gate = first I,      Llama-4
               up = second I) and ``feed_forward.experts.down_proj`` [E, I, H]
gpt_oss        ``mlp.experts.gate_up_proj`` [E, H, 2I] with gate/up INTERLEAVED       gpt-oss
               (gate = ``[..., ::2]``, up = ``[..., 1::2]``), ``gate_up_proj_bias``
               [E, 2I] (interleaved alike), ``down_proj`` [E, I, H], ``down_proj_bias``
               [E, H]
=============  ====================================================================  =========

Whatever precedes ``layers.N.`` (``model.``, ``language_model.model.``,
``model.language_model.``) is accepted, as long as one prefix holds the layer's experts.

What was verified, and how (the ``search`` / ``read_file`` tools over public GitHub source, read
2026-12; no checkpoint was downloaded):

* gpt-oss: ``transformers/models/gpt_oss/modeling_gpt_oss.py`` (``GptOssExperts``): parameters
  ``gate_up_proj`` (E, H, 2I), ``gate_up_proj_bias`` (E, 2I), ``down_proj`` (E, I, H),
  ``down_proj_bias`` (E, H); forward ``x @ gate_up_proj[e] + bias``, then
  ``gate, up = gate_up[..., ::2], gate_up[..., 1::2]`` (interleaved), ``out @ down_proj[e]``.
  The module path ``model.layers.N.mlp.experts`` follows ``GptOssMLP`` (``self.experts``) inside
  the decoder layer's ``mlp``. The released checkpoints store these as MXFP4
  (``gate_up_proj_blocks`` / ``_scales``): not read here (a clear error says so).
* Llama-4: ``transformers/models/llama4/modeling_llama4.py``: ``Llama4TextExperts.gate_up_proj``
  (E, H, 2I), ``down_proj`` (E, I, H), forward ``gate, up = gate_up.chunk(2, dim=-1)`` (NOT
  interleaved); ``Llama4TextDecoderLayer.feed_forward = Llama4TextMoe`` whose ``experts`` is
  ``Llama4TextExperts``.
* Qwen3-MoE: ``transformers/models/qwen3_moe/modeling_qwen3_moe.py``: ``Qwen3MoeDecoderLayer.mlp
  = Qwen3MoeSparseMoeBlock``, ``experts = nn.ModuleList(Qwen3MoeMLP)`` with ``gate_proj``,
  ``up_proj``, ``down_proj`` ``nn.Linear(..., bias=False)``; ``base_model_prefix = "model"``.
* DeepSeek-V3: ``transformers/models/deepseek_v3/modeling_deepseek_v3.py``: ``DeepseekV3MoE.experts
  = nn.ModuleList(DeepseekV3MLP)`` with ``gate_proj``/``up_proj`` Linear(H -> I) and ``down_proj``
  Linear(I -> H), forward ``down(act(gate x) * up x)``. The decoder layer's ``mlp`` attribute and
  the ``model.`` prefix were not read there (they are transformers' convention, as in Qwen3-MoE).
  Kimi-K2 reuses the DeepSeek-V3 architecture (configs/models/kimi-k2.yaml). The FP8 format
  (``weight_scale_inv``, one fp32 scale per 128x128 block, ``w = fp8 * scale``) is the published
  DeepSeek-V3 checkpoint convention; NOT verified against source in this change.
* Mixtral: the ``MixtralBlockSparseTop2MLP`` module tree (``block_sparse_moe.experts.e.w1/w2/w3``,
  ``w1``/``w3`` Linear(H -> I), ``w2`` Linear(I -> H)) as printed in keras-team/keras-hub's
  Mixtral README (a dump of the transformers model), and a MixtralBlockSparseTop2MLP excerpt with
  forward ``w2(silu(w1 x) * w3 x)``.
* OLMoE: NOT verified against source in this change; the names are the issue's
  (``OlmoeSparseMoeBlock.experts`` as a ModuleList of gate/up/down_proj MLPs, as Qwen3-MoE).

Not read: the per-layer fused layout newer transformers versions use in memory (checkpoints on
the Hub keep the per-expert names above), gpt-oss MXFP4 blocks, and sharded checkpoints whose
experts of one layer span several files (pass the shard that holds them all).
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.models import MoEModelShape

__all__ = [
    "FAMILIES",
    "ExpertWeights",
    "family_of_model",
    "file_sha256",
    "load_expert_weights",
    "load_routing",
]

# family -> the configs/models names (base names) that use it
FAMILIES: dict[str, tuple[str, ...]] = {
    "qwen3_moe": ("qwen3-30b-a3b", "qwen3-235b-a22b", "olmoe-1b-7b"),
    "mixtral": ("mixtral-8x7b",),
    "deepseek_v3": ("deepseek-v3", "kimi-k2"),
    "llama4": ("llama-4-scout",),
    "gpt_oss": ("gpt-oss-20b", "gpt-oss-120b"),
}

_FP8_BLOCK = 128  # DeepSeek-V3 / Kimi-K2 FP8 checkpoints: one fp32 scale per 128x128 block


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 (hex) of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


# ------------------------------------------------------------------------------------ routing
def _read_mapping(path: Path, what: str) -> dict[str, Any]:
    """The tensors of a .pt / .safetensors / .npz file as a dict (torch tensors or numpy arrays)."""
    suffix = path.suffix.lower()
    if not path.is_file():
        raise ValueError(f"{path}: {what} file does not exist or is not a file")
    if suffix == ".pt" or suffix == ".pth":
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # pickle errors of every kind: refuse, name the file
            raise ValueError(
                f"{path}: not a readable torch file (torch.load with weights_only=True): {exc}"
            ) from None
        if not isinstance(data, dict):
            raise ValueError(
                f"{path}: a .pt {what} must hold a dict of tensors, got {type(data).__name__}"
            )
        return data
    if suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise ValueError(f"{path}: not a readable safetensors file: {exc}") from None
    if suffix == ".npz":
        import zipfile

        import numpy as np

        try:
            with np.load(path, allow_pickle=False) as npz:
                return {k: npz[k] for k in npz.files}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
            raise ValueError(f"{path}: not a readable .npz file (no pickles): {exc}") from None
    raise ValueError(
        f"{path}: unknown {what} file type {suffix!r}; use .pt, .safetensors or .npz"
    )


def _as_tensor(v: Any, path: Path, name: str) -> torch.Tensor:
    import numpy as np

    if isinstance(v, torch.Tensor):
        return v.detach().cpu()
    if isinstance(v, np.ndarray):
        if v.dtype.kind not in "biuf":
            raise ValueError(f"{path}: {name!r} has unsupported numpy dtype {v.dtype}")
        if v.dtype.kind == "u" and v.dtype.itemsize > 1:
            # torch has few kernels for uint16/32/64: check the range in numpy, widen there
            if v.size and int(v.max()) > np.iinfo(np.int64).max:
                raise ValueError(f"{path}: {name!r} holds ids beyond int64")
            return torch.from_numpy(v.astype(np.int64))
        return torch.from_numpy(np.ascontiguousarray(v))
    raise ValueError(f"{path}: {name!r} must be a tensor / array, got {type(v).__name__}")


def load_routing(
    path: str | os.PathLike,
    *,
    num_experts: int,
    top_k: int,
    num_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Load a router dump: ``(expert_index int64 [T, K], affinity float32 [T, K])`` on the CPU.

    Args:
        path: ``.pt`` (a dict, read with ``torch.load(weights_only=True)``), ``.safetensors`` or
            ``.npz`` holding ``expert_index`` and ``affinity`` (other entries are ignored).
        num_experts: E; ids must lie in [-1, E) (-1 = a dropped slot).
        top_k: K; the dump must have K columns.
        num_tokens: T the dump must have (None: take the dump's T).
    Raises:
        ValueError: naming the file and the rule: unreadable file, a missing entry, a non-integer
            ``expert_index`` or non-floating ``affinity``, not 2-D, different shapes, T or K
            mismatched, ids outside [-1, E), a non-finite affinity on a routed slot, or an
            expert chosen twice by one token.
    """
    p = Path(path)
    data = _read_mapping(p, "routing")
    for key in ("expert_index", "affinity"):
        if key not in data:
            raise ValueError(
                f"{p}: routing file must hold {key!r} (found: {sorted(map(str, data))[:8]})"
            )
    ids = _as_tensor(data["expert_index"], p, "expert_index")
    aff = _as_tensor(data["affinity"], p, "affinity")
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise ValueError(
            f"{p}: 'expert_index' must have an integer dtype, got {ids.dtype}"
        )
    if not aff.is_floating_point():
        raise ValueError(f"{p}: 'affinity' must have a floating dtype, got {aff.dtype}")
    if ids.dim() != 2:
        raise ValueError(f"{p}: 'expert_index' must be 2-D [T, K], got shape {list(ids.shape)}")
    if aff.shape != ids.shape:
        raise ValueError(
            f"{p}: 'affinity' shape {list(aff.shape)} must equal 'expert_index' shape "
            f"{list(ids.shape)}"
        )
    T, K = ids.shape
    if K != top_k:
        raise ValueError(f"{p}: routing has K={K} columns, the model's top_k is {top_k}")
    if num_tokens is not None and T != num_tokens:
        raise ValueError(f"{p}: routing has T={T} tokens, --tokens is {num_tokens}")
    if T < 1:
        raise ValueError(f"{p}: routing has no tokens (T=0)")
    ids64 = ids.to(torch.int64)
    if ids.dtype == torch.uint64 and bool((ids64 < 0).any()):  # >= 2^63 wrapped
        raise ValueError(f"{p}: 'expert_index' holds ids beyond int64")
    lo, hi = int(ids64.min()), int(ids64.max())
    if lo < -1 or hi >= num_experts:
        bad = lo if lo < -1 else hi
        raise ValueError(
            f"{p}: 'expert_index' ids must lie in [-1, {num_experts}) (-1 = dropped slot), "
            f"found {bad}"
        )
    aff32 = aff.to(torch.float32)
    routed = ids64 >= 0
    finite_src = torch.isfinite(aff)  # before the cast: float64 1e300 -> inf is not finite either
    bad = routed & ~(finite_src & torch.isfinite(aff32))
    if bool(bad.any()):
        t, k = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            f"{p}: 'affinity' must be finite on routed slots; token {t} slot {k} holds "
            f"{float(aff[t, k])}"
        )
    srt = torch.sort(ids64, dim=1).values
    dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
    if bool(dup.any()):
        t = int(dup.any(dim=1).nonzero()[0])
        raise ValueError(f"{p}: token {t} chooses one expert twice: {ids64[t].tolist()}")
    return ids64.contiguous(), aff32.contiguous()


# ------------------------------------------------------------------------------------ weights
@dataclass
class ExpertWeights:
    """One MoE layer's routed-expert weights in our layouts (CPU, ``dtype`` of the load)."""

    w_gate_up_EH2I: torch.Tensor
    w_down_EIH: torch.Tensor
    b_gate_up_E2I: torch.Tensor | None = None
    b_down_EH: torch.Tensor | None = None
    family: str = ""
    layer: int = 0


def family_of_model(model: MoEModelShape | str) -> str:
    """The checkpoint family of a configs/models model (its base name decides).

    Raises:
        ValueError: a model no family covers.
    """
    name = model if isinstance(model, str) else model.name
    base = name.split("/")[0].split("@")[0]
    for fam, names in FAMILIES.items():
        if base in names:
            return fam
    raise ValueError(
        f"no Hugging Face weight layout is known for model {base!r}; known: "
        + ", ".join(f"{f} ({', '.join(n)})" for f, n in FAMILIES.items())
    )


_LAYER_RE = re.compile(r"^(?:(.*)\.)?layers\.(\d+)\.(.+)$")


class _Shard:
    """Lazy access to one layer's tensors of a safetensors file, whatever the key prefix."""

    def __init__(self, path: Path, layer: int) -> None:
        from safetensors import SafetensorError, safe_open

        self.path = path
        if not path.is_file():
            raise ValueError(f"{path}: weights file does not exist or is not a file")
        if path.suffix.lower() != ".safetensors":
            raise ValueError(f"{path}: --weights takes a Hugging Face .safetensors shard")
        try:
            self._f = safe_open(str(path), framework="pt", device="cpu")
            keys = list(self._f.keys())
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise ValueError(f"{path}: not a readable safetensors file: {exc}") from None
        self.layer = layer
        self.by_rest: dict[str, str] = {}
        prefixes: dict[str, set[str]] = {}
        for key in keys:
            m = _LAYER_RE.match(key)
            if m and int(m.group(2)) == layer:
                prefixes.setdefault(m.group(3), set()).add(m.group(1) or "")
                self.by_rest[m.group(3)] = key
        self._prefixes = prefixes
        self.layers_present = sorted(
            {int(m.group(2)) for m in map(_LAYER_RE.match, keys) if m}
        )

    def has(self, rest: str) -> bool:
        return rest in self.by_rest

    def get(self, rest: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        if rest not in self.by_rest:
            held = (
                f"it holds layers {self.layers_present[:6]}{'...' if len(self.layers_present) > 6 else ''}"
                if self.layers_present else "it holds no 'layers.N.' tensors"
            )
            raise ValueError(
                f"{self.path}: tensor 'layers.{self.layer}.{rest}' is missing ({held}; experts "
                "may sit in another shard, see model.safetensors.index.json)"
            )
        if len(self._prefixes[rest]) > 1:
            raise ValueError(
                f"{self.path}: tensor 'layers.{self.layer}.{rest}' occurs under several "
                f"prefixes {sorted(self._prefixes[rest])}"
            )
        key = self.by_rest[rest]
        t = self._f.get_tensor(key)
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise ValueError(
                f"{self.path}: tensor {key!r} has shape {list(t.shape)}, expected {list(shape)}"
            )
        return t


def _dequant_fp8(shard: _Shard, rest: str, w: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3-style block FP8: ``w * scale_inv`` per 128x128 block (fp32)."""
    srest = rest[: -len("weight")] + "weight_scale_inv"
    if not shard.has(srest):
        raise ValueError(
            f"{shard.path}: tensor {shard.by_rest[rest]!r} is {w.dtype} but "
            f"'layers.{shard.layer}.{srest}' (its block scales) is missing"
        )
    rows, cols = w.shape
    nb = (-(-rows // _FP8_BLOCK), -(-cols // _FP8_BLOCK))
    s = shard.get(srest, nb).to(torch.float32)
    full = s.repeat_interleave(_FP8_BLOCK, 0)[:rows].repeat_interleave(_FP8_BLOCK, 1)[:, :cols]
    return w.to(torch.float32) * full


def _per_expert(
    shard: _Shard, fmt: str, names: tuple[str, str, str], E: int, H: int, I: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack per-expert Linear weights (gate [I, H], up [I, H], down [H, I]) into our layouts."""
    gate_n, up_n, down_n = names
    w_gu = torch.empty(E, H, 2, I, dtype=dtype)
    w_dn = torch.empty(E, I, H, dtype=dtype)

    def read(rest: str, shape: tuple[int, int]) -> torch.Tensor:
        w = shard.get(rest, shape)
        if w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            w = _dequant_fp8(shard, rest, w)
        elif not w.is_floating_point():
            raise ValueError(
                f"{shard.path}: tensor {shard.by_rest[rest]!r} has non-float dtype {w.dtype}"
            )
        return w

    for e in range(E):
        w_gu[e, :, 0, :] = read(fmt.format(e=e, n=gate_n), (I, H)).t().to(dtype)
        w_gu[e, :, 1, :] = read(fmt.format(e=e, n=up_n), (I, H)).t().to(dtype)
        w_dn[e] = read(fmt.format(e=e, n=down_n), (H, I)).t().to(dtype)
    return w_gu, w_dn


def _float(shard: _Shard, rest: str, t: torch.Tensor) -> torch.Tensor:
    if not t.is_floating_point():
        raise ValueError(
            f"{shard.path}: tensor {shard.by_rest[rest]!r} has non-float dtype {t.dtype}"
        )
    return t


def load_expert_weights(
    path: str | os.PathLike,
    model: MoEModelShape,
    *,
    layer: int = 0,
    family: str | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> ExpertWeights:
    """One MoE layer's routed-expert weights from a Hugging Face safetensors shard.

    Args:
        path: a ``.safetensors`` file holding every routed expert of layer ``layer``.
        model: the model shape; E, H and I of the tensors must equal its (possibly shrunk) E,
            H and I, biases are read when ``model.has_bias``.
        layer: the decoder layer N.
        family: a key of :data:`FAMILIES`; None = :func:`family_of_model`.
        dtype: dtype of the returned tensors (BF16, the problem's compute dtype).
    Returns:
        :class:`ExpertWeights` (CPU).
    Raises:
        ValueError: unknown family, unreadable file, or a tensor missing / of the wrong shape or
            dtype (the message names the file and the tensor).
    """
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise ValueError(f"--layer must be an int >= 0, got {layer!r}")
    fam = family_of_model(model) if family is None else family
    if fam not in FAMILIES:
        raise ValueError(f"unknown weight family {fam!r}; known: {sorted(FAMILIES)}")
    p = Path(path)
    shard = _Shard(p, layer)
    E, H, I = model.experts, model.hidden, model.intermediate
    b_gu = b_dn = None
    if fam in ("qwen3_moe", "deepseek_v3"):
        w_gu, w_dn = _per_expert(shard, "mlp.experts.{e}.{n}.weight",
                                 ("gate_proj", "up_proj", "down_proj"), E, H, I, dtype)
    elif fam == "mixtral":
        w_gu, w_dn = _per_expert(shard, "block_sparse_moe.experts.{e}.{n}.weight",
                                 ("w1", "w3", "w2"), E, H, I, dtype)
    elif fam == "llama4":
        gu_n, dn_n = "feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"
        gu = _float(shard, gu_n, shard.get(gu_n, (E, H, 2 * I)))
        w_gu = gu.reshape(E, H, 2, I).to(dtype).contiguous()  # gate = first I, up = second I
        w_dn = _float(shard, dn_n, shard.get(dn_n, (E, I, H))).to(dtype).contiguous()
    else:  # gpt_oss
        gu_n = "mlp.experts.gate_up_proj"
        if not shard.has(gu_n) and shard.has(gu_n + "_blocks"):
            raise ValueError(
                f"{p}: tensor 'layers.{layer}.{gu_n}' is stored as MXFP4 "
                f"('{gu_n}_blocks' / '_scales'); dequantize the checkpoint to BF16 first"
            )
        gu = _float(shard, gu_n, shard.get(gu_n, (E, H, 2 * I)))
        # interleaved along 2I: column 2i is gate i, column 2i+1 is up i
        w_gu = gu.reshape(E, H, I, 2).transpose(-1, -2).to(dtype).contiguous()
        dn_n = "mlp.experts.down_proj"
        w_dn = _float(shard, dn_n, shard.get(dn_n, (E, I, H))).to(dtype).contiguous()
        if model.has_bias:
            bgu_n, bdn_n = "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias"
            bgu = _float(shard, bgu_n, shard.get(bgu_n, (E, 2 * I)))
            b_gu = bgu.reshape(E, I, 2).transpose(-1, -2).to(dtype).contiguous()
            b_dn = _float(shard, bdn_n, shard.get(bdn_n, (E, H))).to(dtype).contiguous()
    if model.has_bias and b_gu is None:
        raise ValueError(
            f"{p}: model {model.name} has expert biases but the {fam} layout carries none"
        )
    for name, t in (("w_gate_up", w_gu), ("w_down", w_dn)):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{p}: layer {layer}'s {name} weights hold NaN or inf")
    return ExpertWeights(w_gu, w_dn, b_gu, b_dn, family=fam, layer=layer)
