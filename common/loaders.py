"""Real inputs for ``moe-bwd run`` / ``moe-bwd compare``: router dumps and Hugging Face expert
weights (issue 9 item 4).

* :func:`load_routing` reads a router dump: a mapping with ``expert_index`` [T, K] (any integer
  dtype, -1 = dropped slot) and ``affinity`` [T, K] (floating) from a ``.pt`` file (read with
  ``torch.load(weights_only=True)``: no code runs), a ``.safetensors`` file or a ``.npz`` file
  (``allow_pickle=False``). Every rule is checked before any work and a violation is a
  ValueError naming the file and the rule.
* :func:`load_expert_weights` reads one MoE layer's routed experts from a Hugging Face
  safetensors checkpoint -- one shard, a sharded checkpoint's ``model.safetensors.index.json``
  or a directory holding one -- and maps them to our layouts ``w_gate_up_EH2I [E, H, 2, I]``
  (gate at index 0, up at 1) and ``w_down_EIH [E, I, H]`` (plus ``b_gate_up_E2I [E, 2, I]`` and
  ``b_down_EH [E, H]`` for gpt-oss). A missing tensor or a wrong shape is a ValueError naming
  the file and the tensor.

Sharded checkpoints. transformers' ``save_pretrained`` writes ``model.safetensors.index.json``:
a JSON object ``{"metadata": {...}, "weight_map": {tensor name: shard file name}}``, the shards
next to it (format as written by ``create_safetensors_index`` / ``save_sharded_model`` in
``transformers/models/gpt_oss/convert_gpt_oss_weights_to_hf.py``, and by ``save_pretrained``).
The loader reads the index, finds the layer's expert tensors in ``weight_map`` and opens only
the shards that hold them, lazily with ``safetensors.safe_open`` (memory-mapped; a tensor's
shape is checked from the header before its data are read). Shard entries must be plain
``.safetensors`` file names (no directories: nothing outside the index's folder is read).

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
               [E, H]; or MXFP4 ``{gate_up,down}_proj_{blocks,scales}`` (below)
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
  the decoder layer's ``mlp``.
* gpt-oss MXFP4 (the released checkpoints): ``transformers/integrations/mxfp4.py``
  (``Mxfp4GptOssExperts``, ``convert_moe_packed_tensors``) and
  ``transformers/models/gpt_oss/convert_gpt_oss_weights_to_hf.py`` (renames the original
  ``block.N.mlp.mlp1_weight.blocks`` / ``.scales`` to ``model.layers.N.mlp.experts.
  gate_up_proj_blocks`` / ``_scales``, ``mlp2_*`` to ``down_proj_*``, without reordering).
  ``gate_up_proj_blocks`` is uint8 [E, 2I, H/32, 16] and ``gate_up_proj_scales`` uint8
  [E, 2I, H/32]; ``down_proj_blocks`` [E, H, I/32, 16], ``down_proj_scales`` [E, H, I/32]. So
  the packed axis is the INPUT (contraction, K) axis -- H for gate_up, I for down -- in
  nn.Linear ``[out, in]`` order, one E8M0 scale per 32 consecutive K elements. Decoding (HF's
  ``convert_moe_packed_tensors``): byte ``b`` of a 16-byte block gives element ``2b`` (low
  nibble) and ``2b + 1`` (high nibble); the nibble is an FP4 E2M1 code (table ``FP4_VALUES``
  = +0, .5, 1, 1.5, 2, 3, 4, 6, then the same negated: the E2M1 bit patterns); the value is
  ``ldexp(code value, scale - 127)``; the result [E, out, in] is transposed to the parameter
  layout [E, in, out] (``.transpose(1, 2)``), i.e. ``gate_up_proj`` [E, H, 2I] with gate/up
  still interleaved along 2I (row ``2i`` of the blocks is gate ``i``). That is exactly
  :func:`common.mx.dequantize_mx` with ``elem="e2m1"``, ``block_size=32``, ``axis=-1``,
  contiguous groups (its nibble order: even element in the low nibble) on the blocks reshaped
  to [E, out, in/2], which is what the loader calls. The one difference: HF decodes scale byte
  255 as 2^128, E8M0 (OCP MX v1.0) and common/mx as NaN; the loader refuses such a tensor.
  Biases (``gate_up_proj_bias`` [E, 2I], ``down_proj_bias`` [E, H]) stay unquantized.
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
the Hub keep the per-expert names above). No real checkpoint was opened: every layout above is
tested on small files built in its format (tests/test_loaders*.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.models import MoEModelShape

__all__ = [
    "FAMILIES",
    "INDEX_NAME",
    "ExpertWeights",
    "family_of_model",
    "file_sha256",
    "weights_sha256",
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


def weights_sha256(path: str | os.PathLike, model: MoEModelShape, layer: int = 0) -> str:
    """sha256 (hex) of what ``--weights PATH`` reads for ``layer``: the file's bytes for a single
    ``.safetensors`` file; for a sharded checkpoint (index or directory) the sha256 of the lines
    ``<file name>:<sha256 of its bytes>`` of the index and of the shards that hold the layer (the
    files :func:`load_expert_weights` opens), so the digest does not depend on where the
    checkpoint lies and reads only those shards.

    Raises:
        ValueError: as :func:`load_expert_weights` (the layer is located through it).
    """
    p = Path(path)
    if p.is_file() and p.suffix != ".json":
        return file_sha256(p)
    files = load_expert_weights(p, model, layer=layer).files
    lines = "".join(f"{Path(f).name}:{file_sha256(f)}\n" for f in files)
    return hashlib.sha256(lines.encode()).hexdigest()


# ------------------------------------------------------------------------------------ routing
def _read_mapping(path: Path, what: str) -> dict[str, Any]:
    """The tensors of a .pt / .safetensors / .npz file as a dict (torch tensors or numpy arrays).

    A file that cannot be read as its suffix says raises ``ValueError("PATH: not a readable
    router dump (.pt / .safetensors / .npz): ...")`` with the reason.
    """
    suffix = path.suffix.lower()
    if not path.is_file():
        raise ValueError(f"{path}: {what} file does not exist or is not a file")
    unreadable = f"{path}: not a readable router dump (.pt / .safetensors / .npz)"
    if suffix == ".pt" or suffix == ".pth":
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # pickle errors of every kind: refuse, name the file
            raise ValueError(f"{unreadable}: as a torch file, {_torch_load_failure(exc)}"
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
            raise ValueError(f"{unreadable}: as a safetensors file, {exc}") from None
    if suffix == ".npz":
        import zipfile

        import numpy as np

        try:
            with np.load(path, allow_pickle=False) as npz:
                return {k: npz[k] for k in npz.files}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
            raise ValueError(f"{unreadable}: as an .npz file (no pickles), {exc}") from None
    raise ValueError(
        f"{path}: unknown {what} file type {suffix!r}; use .pt, .safetensors or .npz"
    )


def _torch_load_failure(exc: BaseException) -> str:
    """What went wrong in ``torch.load(weights_only=True)``, in words (its raw errors can be a
    bare ``KeyError: 101`` -- a byte the unpickler does not know -- or a page of advice)."""
    import pickle

    text = str(exc).strip()
    not_pickle = ("its bytes are neither a torch.save zip archive nor a pickle (another format, "
                  "or a corrupt file)")
    if isinstance(exc, EOFError):
        return "the file is empty or ends too early (truncated?)"
    if "Weights only load failed" in text:
        # The unpickler's own words follow "WeightsUnpickler error:". Only a global or a call
        # it refuses means a real pickle of Python objects; anything else ("Unsupported operand
        # N": byte N is no pickle opcode) is bytes that are no torch file (random, another format)
        detail = text.split("WeightsUnpickler error:", 1)[-1].strip().split("\n", 1)[0]
        detail = detail.split(". ", 1)[0].strip().rstrip(".")
        if detail.startswith(("Unsupported global", "Trying to")):
            return ("it holds Python objects other than tensors and plain containers, which "
                    "torch.load(weights_only=True) refuses to unpickle; save a dict of tensors "
                    f"(unpickler: {detail})")
        if detail.startswith("Unsupported operand") or not detail or detail == text:
            return not_pickle
        return f"{not_pickle[:-1]}; unpickler: {detail})"
    if isinstance(exc, (KeyError, IndexError, UnicodeDecodeError, pickle.UnpicklingError)) or (
        isinstance(exc, RuntimeError) and "zip archive" in text
    ):
        return not_pickle
    first = text.splitlines()[0] if text else ""
    return f"torch.load failed ({type(exc).__name__}{': ' + first if first else ''})"


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
    files: tuple[str, ...] = ()  # the index (if any) and the shards read, in order


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
# One tensor name (after ``layers.N.``) that tells each family's layout apart, for messages only.
_FAMILY_MARKERS: dict[str, re.Pattern] = {
    "qwen3_moe": re.compile(r"^mlp\.experts\.\d+\.gate_proj\.weight$"),
    "deepseek_v3": re.compile(r"^mlp\.experts\.\d+\.gate_proj\.weight$"),
    "mixtral": re.compile(r"^block_sparse_moe\.experts\.\d+\.w1\.weight$"),
    "llama4": re.compile(r"^feed_forward\.experts\.gate_up_proj$"),
    "gpt_oss": re.compile(r"^mlp\.experts\.gate_up_proj(?:_blocks)?$"),
}


INDEX_NAME = "model.safetensors.index.json"  # transformers' SAFE_WEIGHTS_INDEX_NAME
# gpt-oss MXFP4: one E8M0 scale per 32 FP4 elements of the input (contraction) axis, stored as
# 16 bytes of blocks (transformers ``Mxfp4GptOssExperts``: blocks [..., K // 32, 16]).
_MXFP4_GROUP = 32
_MXFP4_BYTES = _MXFP4_GROUP // 2


def _open_safetensors(path: Path) -> Any:
    """A lazy ``safetensors.safe_open`` handle: memory-mapped, reads only the tensors asked for.

    A module-level function so that tests can record which shards a load opens.
    """
    from safetensors import safe_open

    return safe_open(str(path), framework="pt", device="cpu")


def _resolve_weights(path: Path) -> tuple[Path | None, Path | None]:
    """``(index, shard)`` for a ``--weights`` argument: exactly one of them is not None."""
    if path.is_dir():
        if (path / INDEX_NAME).is_file():
            return path / INDEX_NAME, None
        indexes = sorted(q for q in path.glob("*.safetensors.index.json") if q.is_file())
        if len(indexes) > 1:
            raise ValueError(
                f"{path}: the directory holds several safetensors indexes "
                f"({', '.join(q.name for q in indexes)}) and no {INDEX_NAME}; pass one of them"
            )
        if indexes:
            return indexes[0], None
        shards = sorted(q for q in path.glob("*.safetensors") if q.is_file())
        if len(shards) == 1:
            return None, shards[0]
        raise ValueError(
            f"{path}: a --weights directory must hold {INDEX_NAME} or exactly one .safetensors "
            f"file; it holds no index and {len(shards)} .safetensors files"
        )
    if not path.exists():
        raise ValueError(
            f"{path}: --weights path does not exist (give a .safetensors file, a "
            f"{INDEX_NAME} or a checkpoint directory)"
        )
    if not path.is_file():
        raise ValueError(
            f"{path}: --weights path is neither a file nor a directory (give a .safetensors "
            f"file, a {INDEX_NAME} or a checkpoint directory)"
        )
    if path.name.lower().endswith(".json"):
        return path, None
    if path.suffix.lower() == ".safetensors":
        return None, path
    raise ValueError(
        f"{path}: --weights takes a Hugging Face .safetensors shard, a {INDEX_NAME} or a "
        "directory holding one"
    )


def _read_index(index: Path) -> dict[str, Path]:
    """``weight_map`` of a safetensors index: tensor name -> shard path (next to the index).

    The format is transformers' (``save_pretrained`` with sharding): a JSON object with
    ``"metadata"`` (ignored) and ``"weight_map"``: ``{tensor name: shard file name}``.
    """
    try:
        text = index.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{index}: not a readable safetensors index: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{index}: not valid JSON ({exc}); a safetensors index is a JSON object with a "
            "'weight_map'"
        ) from None
    wmap = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wmap, dict) or not wmap:
        raise ValueError(
            f"{index}: a safetensors index must be a JSON object whose 'weight_map' maps "
            "tensor names to shard files (non-empty)"
        )
    out: dict[str, Path] = {}
    for name, shard in wmap.items():
        if (not isinstance(shard, str) or not shard.endswith(".safetensors")
                or "/" in shard or "\\" in shard or shard.startswith(".")):
            raise ValueError(
                f"{index}: weight_map[{name!r}] = {shard!r}: shard entries must be plain "
                ".safetensors file names in the index's directory"
            )
        out[name] = index.parent / shard
    return out


class _Source:
    """Lazy access to one layer's tensors of a safetensors shard or a sharded checkpoint.

    Whatever precedes ``layers.N.`` in a tensor name is accepted, as long as one prefix holds
    the layer's tensor. With an index, no shard is opened until one of its tensors is read, and
    only the shards that hold a requested tensor are opened (``opened``).
    """

    def __init__(self, path: Path, layer: int) -> None:
        self.path = path
        self.layer = layer
        self.family: str | None = None  # the layout asked for (set by load_expert_weights)
        self._handles: dict[Path, tuple[Any, set[str]]] = {}
        self.index, single = _resolve_weights(path)
        if self.index is not None:
            key_file = _read_index(self.index)
        else:
            assert single is not None
            _, keys = self._open(single)
            key_file = dict.fromkeys(sorted(keys), single)
        self._key_file = key_file
        self.by_rest: dict[str, str] = {}
        self._prefixes: dict[str, set[str]] = {}
        layers: set[int] = set()
        for key in key_file:
            m = _LAYER_RE.match(key)
            if not m:
                continue
            layers.add(int(m.group(2)))
            if int(m.group(2)) == layer:
                self._prefixes.setdefault(m.group(3), set()).add(m.group(1) or "")
                self.by_rest[m.group(3)] = key
        self.layers_present = sorted(layers)

    @property
    def opened(self) -> list[Path]:
        """The shards opened so far, in order."""
        return list(self._handles)

    def _open(self, shard: Path) -> tuple[Any, set[str]]:
        from safetensors import SafetensorError

        if shard in self._handles:
            return self._handles[shard]
        if not shard.is_file():
            raise ValueError(
                f"{self.index}: its weight_map names shard {shard.name!r}, which is not a file "
                f"in {shard.parent}"
            )
        try:
            handle = _open_safetensors(shard)
            keys = set(handle.keys())
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise ValueError(f"{shard}: not a readable safetensors file: {exc}") from None
        self._handles[shard] = (handle, keys)
        return handle, keys

    def has(self, rest: str) -> bool:
        return rest in self.by_rest

    def other_family(self) -> str | None:
        """For a missing tensor: the families whose layout the layer's tensor names follow when
        that is not the one asked for (e.g. ``"mixtral (mixtral-8x7b)"``), else None."""
        own = _FAMILY_MARKERS.get(self.family or "")
        if own is None:
            return None
        found = [
            f"{fam} ({', '.join(FAMILIES[fam])})"
            for fam, rx in _FAMILY_MARKERS.items()
            if rx.pattern != own.pattern and any(rx.match(r) for r in self.by_rest)
        ]
        return " or ".join(found) or None

    def key(self, rest: str) -> str:
        """The full tensor name of ``layers.N.<rest>``; a ValueError when absent or ambiguous."""
        where = self.index or self.path
        if rest not in self.by_rest:
            held = (
                f"it holds layers {self.layers_present[:6]}"
                f"{'...' if len(self.layers_present) > 6 else ''}"
                if self.layers_present else "it holds no 'layers.N.' tensors"
            )
            other = self.other_family()
            if other is not None:
                hint = (
                    f"; its tensor names follow the {other} layout, not the {self.family} layout "
                    "of the model asked for: is the model the checkpoint's?"
                )
            elif self.index is None:
                hint = (
                    f"; experts may sit in another shard: pass the checkpoint's {INDEX_NAME} or "
                    "its directory"
                )
            else:
                hint = ""
            raise ValueError(
                f"{where}: tensor 'layers.{self.layer}.{rest}' is missing ({held}{hint})"
            )
        if len(self._prefixes[rest]) > 1:
            raise ValueError(
                f"{where}: tensor 'layers.{self.layer}.{rest}' occurs under several "
                f"prefixes {sorted(self._prefixes[rest])}"
            )
        return self.by_rest[rest]

    def file_of(self, rest: str) -> Path:
        """The shard that holds ``layers.N.<rest>`` (for messages)."""
        return self._key_file[self.key(rest)]

    def get(self, rest: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        from safetensors import SafetensorError

        key = self.key(rest)
        shard = self._key_file[key]
        handle, keys = self._open(shard)
        if key not in keys:
            raise ValueError(
                f"{shard}: tensor {key!r} is not in this shard, though {self.index} maps it here"
            )
        try:
            got = tuple(handle.get_slice(key).get_shape())  # the header only: no data read
            if shape is not None and got != tuple(shape):
                raise ValueError(
                    f"{shard}: tensor {key!r} has shape {list(got)}, expected {list(shape)}"
                )
            return handle.get_tensor(key)
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise ValueError(f"{shard}: tensor {key!r} could not be read: {exc}") from None

    def files(self) -> tuple[str, ...]:
        """The index (if any) and the shards read, as strings."""
        head = (str(self.index),) if self.index is not None else ()
        return head + tuple(str(p) for p in self._handles)


def _dequant_fp8(shard: _Source, rest: str, w: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3-style block FP8: ``w * scale_inv`` per 128x128 block (fp32)."""
    srest = rest[: -len("weight")] + "weight_scale_inv"
    if not shard.has(srest):
        raise ValueError(
            f"{shard.file_of(rest)}: tensor {shard.key(rest)!r} is {w.dtype} but "
            f"'layers.{shard.layer}.{srest}' (its block scales) is missing"
        )
    rows, cols = w.shape
    nb = (-(-rows // _FP8_BLOCK), -(-cols // _FP8_BLOCK))
    s = shard.get(srest, nb).to(torch.float32)
    full = s.repeat_interleave(_FP8_BLOCK, 0)[:rows].repeat_interleave(_FP8_BLOCK, 1)[:, :cols]
    return w.to(torch.float32) * full


def _mxfp4(src: _Source, rest: str, E: int, out_dim: int, in_dim: int,
           dtype: torch.dtype) -> torch.Tensor:
    """gpt-oss MXFP4 ``<rest>_blocks`` / ``<rest>_scales`` -> [E, out_dim, in_dim] in ``dtype``.

    Blocks are uint8 [E, out, in / 32, 16] (two E2M1 codes per byte, the even element in the
    low nibble), scales uint8 E8M0 [E, out, in / 32] (one per 32 consecutive elements of the
    input axis): decoded with :func:`common.mx.dequantize_mx` (``elem="e2m1"``,
    ``block_size=32``, contiguous groups along the last axis), one expert at a time so the peak
    memory stays one expert's. Every decoded value (an E2M1 value times a power of two) is exact
    in fp32 and in BF16.
    """
    from common.mx import E8M0_NAN, dequantize_mx

    bn, sn = rest + "_blocks", rest + "_scales"
    if in_dim % _MXFP4_GROUP:
        raise ValueError(
            f"{src.file_of(bn)}: MXFP4 {src.key(bn)!r} groups {_MXFP4_GROUP} elements of the "
            f"input axis per scale; the model's input size {in_dim} is not a multiple of "
            f"{_MXFP4_GROUP}"
        )
    G = in_dim // _MXFP4_GROUP
    blocks = src.get(bn, (E, out_dim, G, _MXFP4_BYTES))
    if blocks.dtype != torch.uint8:
        raise ValueError(
            f"{src.file_of(bn)}: MXFP4 blocks {src.key(bn)!r} must be uint8 (two FP4 E2M1 "
            f"codes per byte), got {blocks.dtype}"
        )
    scales = src.get(sn, (E, out_dim, G))
    if scales.dtype not in (torch.uint8, torch.float8_e8m0fnu):
        raise ValueError(
            f"{src.file_of(sn)}: MXFP4 scales {src.key(sn)!r} must be uint8 E8M0 bytes, got "
            f"{scales.dtype}"
        )
    sbytes = scales.view(torch.uint8)
    if bool((sbytes == E8M0_NAN).any()):
        raise ValueError(
            f"{src.file_of(sn)}: MXFP4 scales {src.key(sn)!r} hold byte {E8M0_NAN}, the E8M0 "
            "NaN (OCP MX v1.0)"
        )
    out = torch.empty(E, out_dim, in_dim, dtype=dtype)
    for e in range(E):
        out[e] = dequantize_mx(
            blocks[e].reshape(out_dim, G * _MXFP4_BYTES), sbytes[e], elem="e2m1",
            block_size=_MXFP4_GROUP, axis=-1, layout="contiguous", dtype=torch.float32,
        )
    return out


def _gpt_oss_weight(src: _Source, rest: str, E: int, in_dim: int, out_dim: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """A gpt-oss expert weight in its parameter layout [E, in, out], BF16 or MXFP4 on disk."""
    bn, sn = rest + "_blocks", rest + "_scales"
    plain, packed = src.has(rest), src.has(bn) or src.has(sn)
    where = src.index or src.path
    if plain and packed:
        raise ValueError(
            f"{where}: layer {src.layer} holds both {rest!r} and its MXFP4 '{bn}' / '{sn}'; "
            "a checkpoint stores one of the two"
        )
    if plain:
        return _float(src, rest, src.get(rest, (E, in_dim, out_dim))).to(dtype)
    if not packed:
        other = src.other_family()
        raise ValueError(
            f"{where}: tensor 'layers.{src.layer}.{rest}' is missing: "
            f"neither {rest!r} nor its MXFP4 '{bn}' / '{sn}' is there (layers held: "
            f"{src.layers_present[:6]}{'...' if len(src.layers_present) > 6 else ''})"
            + (f"; its tensor names follow the {other} layout, not the {src.family} layout of "
               "the model asked for: is the model the checkpoint's?" if other else "")
        )
    src.key(bn), src.key(sn)  # both halves present, before any read
    # MXFP4 tensors are [E, out, in] (nn.Linear order); the parameter is their transpose
    return _mxfp4(src, rest, E, out_dim, in_dim, dtype).transpose(1, 2)


def _per_expert(
    shard: _Source, fmt: str, names: tuple[str, str, str], E: int, H: int, I: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack per-expert Linear weights (gate [I, H], up [I, H], down [H, I]) into our layouts."""
    gate_n, up_n, down_n = names
    for e in range(E):  # every tensor listed before any is read
        for n in names:
            shard.key(fmt.format(e=e, n=n))
    w_gu = torch.empty(E, H, 2, I, dtype=dtype)
    w_dn = torch.empty(E, I, H, dtype=dtype)

    def read(rest: str, shape: tuple[int, int]) -> torch.Tensor:
        w = shard.get(rest, shape)
        if w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            w = _dequant_fp8(shard, rest, w)
        return _float(shard, rest, w)

    for e in range(E):
        w_gu[e, :, 0, :] = read(fmt.format(e=e, n=gate_n), (I, H)).t().to(dtype)
        w_gu[e, :, 1, :] = read(fmt.format(e=e, n=up_n), (I, H)).t().to(dtype)
        w_dn[e] = read(fmt.format(e=e, n=down_n), (H, I)).t().to(dtype)
    return w_gu, w_dn


def _float(shard: _Source, rest: str, t: torch.Tensor) -> torch.Tensor:
    if not t.is_floating_point():
        raise ValueError(
            f"{shard.file_of(rest)}: tensor {shard.key(rest)!r} has non-float dtype {t.dtype}"
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
    """One MoE layer's routed-expert weights from a Hugging Face safetensors checkpoint.

    Args:
        path: one of
            * a ``.safetensors`` file holding every routed expert of layer ``layer``;
            * a sharded checkpoint's index (``model.safetensors.index.json``, or any
              ``*.json`` in that format: ``{"weight_map": {tensor name: shard file}}``);
            * a directory holding ``model.safetensors.index.json`` (else exactly one
              ``*.safetensors.index.json``, else exactly one ``.safetensors`` file).
            With an index only the shards that hold the layer's expert tensors are opened,
            lazily (``safetensors.safe_open``, memory-mapped: only those tensors are read).
        model: the model shape; E, H and I of the tensors must equal its (possibly shrunk) E,
            H and I, biases are read when ``model.has_bias``.
        layer: the decoder layer N.
        family: a key of :data:`FAMILIES`; None = :func:`family_of_model`.
        dtype: dtype of the returned tensors (BF16, the problem's compute dtype).
    Returns:
        :class:`ExpertWeights` (CPU); ``files`` lists the index and the shards read.
    Raises:
        ValueError: unknown family; an unreadable file, directory or index (bad JSON, no
            ``weight_map``, a shard entry that is not a plain file name, a shard that does not
            exist or lacks a tensor the index puts there); a tensor missing / of the wrong shape
            or dtype; NaN / inf weights or an E8M0 NaN scale. The message names the file and the
            rule. Nothing is written anywhere.
    """
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise ValueError(f"--layer must be an int >= 0, got {layer!r}")
    fam = family_of_model(model) if family is None else family
    if fam not in FAMILIES:
        raise ValueError(f"unknown weight family {fam!r}; known: {sorted(FAMILIES)}")
    p = Path(path)
    src = _Source(p, layer)
    src.family = fam
    where = src.index or src.path
    E, H, I = model.experts, model.hidden, model.intermediate
    b_gu = b_dn = None
    if fam in ("qwen3_moe", "deepseek_v3"):
        w_gu, w_dn = _per_expert(src, "mlp.experts.{e}.{n}.weight",
                                 ("gate_proj", "up_proj", "down_proj"), E, H, I, dtype)
    elif fam == "mixtral":
        w_gu, w_dn = _per_expert(src, "block_sparse_moe.experts.{e}.{n}.weight",
                                 ("w1", "w3", "w2"), E, H, I, dtype)
    elif fam == "llama4":
        gu_n, dn_n = "feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"
        src.key(gu_n), src.key(dn_n)
        gu = _float(src, gu_n, src.get(gu_n, (E, H, 2 * I)))
        w_gu = gu.reshape(E, H, 2, I).to(dtype).contiguous()  # gate = first I, up = second I
        w_dn = _float(src, dn_n, src.get(dn_n, (E, I, H))).to(dtype).contiguous()
    else:  # gpt_oss: BF16 parameters or MXFP4 blocks / scales (see the module docstring)
        gu_n, dn_n = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
        bgu_n, bdn_n = "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias"
        if model.has_bias:
            src.key(bgu_n), src.key(bdn_n)
        gu = _gpt_oss_weight(src, gu_n, E, H, 2 * I, dtype)  # [E, H, 2I]
        # interleaved along 2I: column 2i is gate i, column 2i+1 is up i
        w_gu = gu.reshape(E, H, I, 2).transpose(-1, -2).contiguous()
        w_dn = _gpt_oss_weight(src, dn_n, E, I, H, dtype).contiguous()  # [E, I, H]
        if model.has_bias:
            bgu = _float(src, bgu_n, src.get(bgu_n, (E, 2 * I)))
            b_gu = bgu.reshape(E, I, 2).transpose(-1, -2).to(dtype).contiguous()
            b_dn = _float(src, bdn_n, src.get(bdn_n, (E, H))).to(dtype).contiguous()
    if model.has_bias and b_gu is None:
        raise ValueError(
            f"{where}: model {model.name} has expert biases but the {fam} layout carries none"
        )
    for name, t in (("w_gate_up", w_gu), ("w_down", w_dn)):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{where}: layer {layer}'s {name} weights hold NaN or inf")
    return ExpertWeights(w_gu, w_dn, b_gu, b_dn, family=fam, layer=layer, files=src.files())
