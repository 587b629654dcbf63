"""Gradient bundles: one backend's gradients of one problem, saved so another machine can compare.

A bundle is a directory holding two files and nothing that executes:

* ``bundle.json`` -- ``{"format": "moe-bwd-bundle", "version": 2, "spec": {...},
  "inputs_sha256": {tensor name: hex}, "gradients": {"file", "sha256", "tensors"},
  "metadata": {...}}``: the :class:`ProblemSpec` the inputs are re-created from, a sha256 digest
  of every input tensor, the digest of the gradient file, and metadata (backend, device name and
  capability, package / torch / CuTe DSL versions, UTC date, wall times, JSON-able backend info).
* ``gradients.safetensors`` -- the gradients by their :class:`~common.problem.MoEGrads` field
  names (``hidden_states_grad_TH``, ``affinity_grad_TE``, ...), in the dtype the backend returned.

Inputs are always built on the CPU from the spec (seeded draws, simulated router, the BF16
forward checkpoint computed by the CPU's torch), then moved to the device, so every machine starts
from the same bits; :func:`load_bundle` re-creates them and refuses a bundle whose digests differ
(the error names the file and the tensors). Loading reads JSON and safetensors only: no pickle,
no ``torch.load``.

A CPU that computes the fp32 checkpoint forward or the router's softmax differently (another
BLAS / vector ISA) re-creates different inputs; the digest check then says so instead of
comparing gradients of two different problems.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import platform
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

import torch

from common.models import MoEModelShape, load_model
from common.problem import MoEBackwardProblem, MoEGrads

__all__ = [
    "BUNDLE_FORMAT",
    "BUNDLE_VERSION",
    "GRAD_FIELDS",
    "Bundle",
    "ProblemSpec",
    "build_problem",
    "check_bundle_destination",
    "check_creatable_dir",
    "collect_metadata",
    "input_digests",
    "load_bundle",
    "problem_to",
    "save_bundle",
    "tensor_sha256",
]

BUNDLE_FORMAT = "moe-bwd-bundle"
BUNDLE_VERSION = 2
# 2: the seeded inputs come from common.counter_rng (the same bits on every device); version 1
# bundles were drawn by torch's CPU generator, which this package no longer re-creates.
_VERSION_NOTES = {
    1: "its seeded inputs were drawn by torch's CPU generator, which this package no longer "
       "uses (inputs now come from the counter-based common.counter_rng): save it again with "
       "this package's `moe-bwd run ... --save`",
}
MANIFEST = "bundle.json"
GRADIENTS = "gradients.safetensors"
GRAD_FIELDS = (
    "hidden_states_grad_TH",
    "affinity_grad_TE",
    "w_gate_up_grad_EH2I",
    "w_down_grad_EIH",
    "b_gate_up_grad_E2I",
    "b_down_grad_EH",
)
_REQUIRED_GRADS = GRAD_FIELDS[:4]


# ---------------------------------------------------------------------------------- the spec
@dataclass(frozen=True)
class ProblemSpec:
    """Everything that determines a problem's inputs (JSON-able; :func:`build_problem` builds it).

    Attributes:
        model: base model name of ``configs/models`` (e.g. ``"qwen3-30b-a3b"``).
        hidden, intermediate: H and I actually used (after ``--shrink`` or another scaling).
        experts, top_k: E and K (checked against the model config when re-created).
        tokens: T.  seed: seed of every draw.  skew: router load skew.
        shrink: the ``--shrink`` factor that gave H and I (1 = full size; display only).
        dtype: compute dtype of inputs and checkpoint (``"bfloat16"``).

        routing_sha256: sha256 of the router dump (``--routing``) that replaced the router
            simulation, or None (simulated).
        weights_sha256, layer: sha256 of the Hugging Face safetensors shard (``--weights``) and
            the layer read from it, or None (seeded weights).

    The files themselves are not stored (only their digests; paths differ between machines):
    :func:`build_problem` takes them again and refuses a file whose sha256 differs. The three
    fields are left out of :meth:`to_json` when None, so simulated specs read as before and
    bundles written before they existed load unchanged.
    """

    model: str
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    tokens: int
    seed: int = 0
    skew: float = 1.0
    shrink: int = 1
    dtype: str = "bfloat16"
    routing_sha256: str | None = None
    weights_sha256: str | None = None
    layer: int | None = None

    @classmethod
    def for_model(
        cls, model: MoEModelShape, tokens: int, *, seed: int = 0, skew: float = 1.0,
        shrink: int = 1, **extra: Any,
    ) -> ProblemSpec:
        """The spec of ``model`` (possibly shrunk or scaled) with T = ``tokens``."""
        return cls(
            model=base_model_name(model.name), hidden=model.hidden,
            intermediate=model.intermediate, experts=model.experts, top_k=model.top_k,
            tokens=tokens, seed=seed, skew=float(skew), shrink=shrink, **extra,
        )

    @property
    def is_shrunk(self) -> bool:
        return self.shrink != 1

    @property
    def real_inputs(self) -> bool:
        """True when routing or weights come from files."""
        return self.routing_sha256 is not None or self.weights_sha256 is not None

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k in _OPTIONAL_SPEC_FIELDS:
            if d[k] is None:
                del d[k]
        return d

    def differences(self, other: ProblemSpec) -> str:
        """The fields where ``other`` differs from this spec, ``"seed 0 -> 1, tokens 8 -> 16"``
        (this spec's value first; a field only one of them has shows as None)."""
        mine, theirs = self.to_json(), other.to_json()
        return ", ".join(
            f"{k} {mine.get(k)!r} -> {theirs.get(k)!r}"
            for k in dict.fromkeys([*mine, *theirs]) if mine.get(k) != theirs.get(k)
        )

    @classmethod
    def from_json(cls, data: Any, where: str = "spec") -> ProblemSpec:
        """Parse a spec mapping; ValueError naming ``where`` and the field on any bad value."""
        if not isinstance(data, dict):
            raise ValueError(f"{where}: the problem spec must be a JSON object")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"{where}: unknown spec field(s) {unknown}")
        kwargs = dict(data)
        for k in ("hidden", "intermediate", "experts", "top_k", "tokens", "seed", "shrink"):
            v = kwargs.get(k)
            if k not in kwargs or isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{where}: spec field {k!r} must be an int, got {v!r}")
        if not isinstance(kwargs.get("model"), str):
            raise ValueError(f"{where}: spec field 'model' must be a string")
        if not isinstance(kwargs.get("skew", 1.0), (int, float)):
            raise ValueError(f"{where}: spec field 'skew' must be a number")
        for k in ("routing_sha256", "weights_sha256"):
            v = kwargs.get(k)
            if v is not None and not (isinstance(v, str) and _SHA256_RE.match(v)):
                raise ValueError(f"{where}: spec field {k!r} must be a sha256 hex digest, got {v!r}")
        v = kwargs.get("layer")
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ValueError(f"{where}: spec field 'layer' must be an int >= 0, got {v!r}")
        if (kwargs.get("layer") is None) != (kwargs.get("weights_sha256") is None):
            raise ValueError(f"{where}: spec fields 'layer' and 'weights_sha256' go together")
        return cls(**kwargs)


_OPTIONAL_SPEC_FIELDS = ("routing_sha256", "weights_sha256", "layer")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


def base_model_name(name: str) -> str:
    """``"qwen3-30b-a3b/4"`` or ``"olmoe-1b-7b@h128-i128"`` -> the configs/models name."""
    return name.split("/")[0].split("@")[0]


def model_of_spec(spec: ProblemSpec) -> MoEModelShape:
    """The model shape of a spec: the shipped config with the spec's H and I.

    Raises:
        ValueError: unknown model, or a config whose E / top_k differ from the spec's.
    """
    base = load_model(spec.model)
    if (base.experts, base.top_k) != (spec.experts, spec.top_k):
        raise ValueError(
            f"model {spec.model!r}: configs/models has E={base.experts}, top_k={base.top_k}; "
            f"the spec has E={spec.experts}, top_k={spec.top_k} (the config changed)"
        )
    if (base.hidden, base.intermediate) == (spec.hidden, spec.intermediate):
        return base
    name = f"{base.name}/{spec.shrink}" if spec.is_shrunk else None
    return base.scaled(hidden=spec.hidden, intermediate=spec.intermediate, name=name)


def build_problem(
    spec: ProblemSpec, device: str | torch.device = "cpu", *,
    routing_file: str | os.PathLike | None = None,
    weights_file: str | os.PathLike | None = None,
) -> MoEBackwardProblem:
    """Re-create the problem of ``spec`` on the CPU (bit-identical on every machine whose CPU
    computes the same fp32 forward), then move it to ``device``.

    A spec made from a router dump / a weights shard needs the same file again
    (``routing_file`` / ``weights_file``); its sha256 must equal the spec's.

    Raises:
        ValueError: a file the spec needs is not given, a file is given the spec does not
            name, a file's sha256 differs from the spec's, or a loader's error.
    """
    from common.inputs import make_problem_for_model
    from common.loaders import load_expert_weights, load_routing

    if spec.dtype != "bfloat16":
        raise ValueError(f"spec dtype {spec.dtype!r}: only 'bfloat16' problems are built")
    model = model_of_spec(spec)
    for flag, want, given in (("--routing", spec.routing_sha256, routing_file),
                              ("--weights", spec.weights_sha256, weights_file)):
        if want is not None and given is None:
            raise ValueError(
                f"the problem was made from a {flag} file (sha256 {want[:12]}...); pass it "
                f"again with {flag} FILE"
            )
        if want is None and given is not None:
            raise ValueError(f"{given}: {flag} given, but the problem was made without one")
        if given is not None:
            if flag == "--weights":
                from common.loaders import weights_sha256

                got = weights_sha256(given, model, spec.layer or 0)
            else:
                got = _file_sha256(Path(given))
            if got != want:
                raise ValueError(
                    f"{given}: sha256 {got[:12]}... differs from the problem's {want[:12]}... "
                    f"({flag} is another file than the one the problem was made from)"
                )
    routing = None
    if routing_file is not None:
        routing = load_routing(routing_file, num_experts=model.experts, top_k=model.top_k,
                               num_tokens=spec.tokens)
    weights = None
    if weights_file is not None:
        weights = load_expert_weights(weights_file, model, layer=spec.layer or 0)
    problem = make_problem_for_model(
        model, spec.tokens, seed=spec.seed, device="cpu", skew=spec.skew,
        routing=routing, weights=weights,
    )
    return problem_to(problem, device)


def problem_to(problem: MoEBackwardProblem, device: str | torch.device) -> MoEBackwardProblem:
    """A copy of ``problem`` with every tensor (plan included) on ``device``."""
    dev = torch.device(device)
    if problem.hidden_states_TH.device == dev:
        return problem

    def mv(obj):
        moved = {}
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if isinstance(v, torch.Tensor):
                moved[f.name] = v.to(dev)
        return dataclasses.replace(obj, **moved)

    return dataclasses.replace(mv(problem), plan=mv(problem.plan))


# --------------------------------------------------------------------------------- digests
def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and raw bytes (row-major, little-endian as stored)."""
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel():
        h.update(flat.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def input_digests(problem: MoEBackwardProblem) -> dict[str, str]:
    """sha256 of every input tensor of ``problem`` (weights, activations, checkpoint, plan)."""
    named: dict[str, torch.Tensor | None] = {
        "hidden_states_TH": problem.hidden_states_TH,
        "output_grad_TH": problem.output_grad_TH,
        "w_gate_up_EH2I": problem.w_gate_up_EH2I,
        "w_down_EIH": problem.w_down_EIH,
        "act_checkpoint_R2I": problem.act_checkpoint_R2I,
        "b_gate_up_E2I": problem.b_gate_up_E2I,
        "b_down_EH": problem.b_down_EH,
        "plan.pair_token_R": problem.plan.pair_token_R,
        "plan.pair_expert_R": problem.plan.pair_expert_R,
        "plan.pair_affinity_R": problem.plan.pair_affinity_R,
        "plan.slot_to_pair_TK": problem.plan.slot_to_pair_TK,
    }
    return {k: tensor_sha256(v) for k, v in named.items() if v is not None}


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


# ------------------------------------------------------------------------------- metadata
def _version(dist: str) -> str | None:
    try:
        return importlib_metadata.version(dist)
    except importlib_metadata.PackageNotFoundError:
        return None


def collect_metadata(
    backend: str, device: str | torch.device, wall_s: dict[str, float] | None = None,
    info: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Backend, device name / capability, versions, UTC date, wall times, JSON-able info."""
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(dev)
        cap = ".".join(map(str, torch.cuda.get_device_capability(dev)))
    else:
        name, cap = _host_device_name(dev), None
    return {
        "backend": backend,
        "device": str(dev),
        "device_name": name,
        "device_capability": cap,
        "host": platform.platform(),
        "versions": {
            "moe-bwd-kernels": _version("moe-bwd-kernels"),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "nvidia-cutlass-dsl": _version("nvidia-cutlass-dsl"),
            "python": platform.python_version(),
        },
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "wall_s": dict(wall_s or {}),
        "info": _jsonable(info or {}),
    }


def _host_device_name(dev: torch.device) -> str:
    """``"cpu (<CPU model>)"`` for a CPU (Linux: /proc/cpuinfo's model name, else what
    ``platform`` says), the device type otherwise: what a label like ``torch@...`` needs."""
    model = ""
    if dev.type == "cpu":
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                model = next((ln.split(":", 1)[1] for ln in f if ln.startswith("model name")), "")
        except OSError:
            pass
        model = " ".join(model.replace("(R)", "").replace("(TM)", "").split())
        model = model or platform.processor() or platform.machine()
    return f"{dev.type} ({model})" if model else dev.type


def _jsonable(obj: Any) -> Any:
    """Keep what JSON can hold (dicts of str keys, lists, str, numbers, bool, None); drop the
    rest (profiler objects, tensors)."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            j = _jsonable(v)
            if isinstance(k, str) and j is not _DROP:
                out[k] = j
        return out
    if isinstance(obj, (list, tuple)):
        return [j for j in (_jsonable(v) for v in obj) if j is not _DROP]
    if obj is None or isinstance(obj, (str, bool, int, float)):
        return obj
    return _DROP


_DROP = object()


# ----------------------------------------------------------------------------- save / load
@dataclass
class Bundle:
    """A loaded bundle. ``grads`` are on the CPU in the stored dtype."""

    path: Path
    spec: ProblemSpec
    inputs_sha256: dict[str, str]
    grads: MoEGrads
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def backend(self) -> str:
        return str(self.metadata.get("backend", "?"))

    @property
    def label(self) -> str:
        """``backend@device_name`` (for tables and plots)."""
        dn = self.metadata.get("device_name")
        return f"{self.backend}@{dn}" if dn else self.backend


def check_bundle_destination(
    path: str | os.PathLike, spec: ProblemSpec | None = None, *, force: bool = False,
    force_hint: str = "force=True",
) -> None:
    """Whether :func:`save_bundle` may write a bundle of ``spec`` to ``path``; cheap, writes
    nothing that stays (a probe directory is made and removed where the bundle would go).

    Allowed: a new path (its parents are created), an empty directory, or a bundle of the same
    problem (replaced). Refused: a file, a directory holding other files than a bundle's, a
    place that cannot be written, and -- unless ``force`` -- a bundle of another problem (or one
    whose manifest cannot be read). ``spec=None`` skips the problem comparison.

    Raises:
        ValueError: ``"<path>: <the rule>"``; ``force_hint`` names how to replace another
            problem's bundle (``"--force"`` on the command line).
    """
    dest = Path(path)
    if dest.exists() or dest.is_symlink():
        if not dest.is_dir():
            raise ValueError(f"{dest}: exists and is not a directory")
        entries = set(os.listdir(dest))
        if entries and not entries <= {MANIFEST, GRADIENTS}:
            raise ValueError(
                f"{dest}: the directory exists and holds other files than a bundle's "
                f"({sorted(entries - {MANIFEST, GRADIENTS})[:3]}); choose an empty or new one"
            )
        if MANIFEST in entries and spec is not None and not force:
            try:
                other = read_manifest(dest)["spec"]
            except ValueError as exc:
                raise ValueError(
                    f"{dest}: holds a bundle whose manifest cannot be read ({exc}); {force_hint} "
                    "replaces it"
                ) from None
            if other != spec:
                raise ValueError(
                    f"{dest}: holds a bundle of another problem ({other.differences(spec)}); "
                    f"choose another directory, or {force_hint} replaces it"
                )
    check_creatable_dir(dest)


def check_creatable_dir(path: str | os.PathLike) -> None:
    """``path`` is a directory, or can become one, that this process can write into: the nearest
    existing ancestor is a directory in which a probe directory is made and removed (nothing
    stays).

    Raises:
        ValueError: ``"<path>: <the rule>"`` (a file in the way; no permission).
    """
    dest = Path(path)
    if dest.exists() and not dest.is_dir():
        raise ValueError(f"{dest}: exists and is not a directory")
    anc = dest if dest.is_dir() else dest.parent
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise ValueError(f"{dest}: {anc} is not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".moe-bwd-probe.", dir=anc))
    except OSError as exc:
        raise ValueError(
            f"{dest}: cannot create a directory in {anc} ({exc.strerror or exc})"
        ) from None


def save_bundle(
    path: str | os.PathLike, spec: ProblemSpec, problem: MoEBackwardProblem, grads: MoEGrads,
    metadata: dict[str, Any], *, force: bool = False,
) -> Path:
    """Write a bundle directory (see the module docstring); return its path.

    Written to a temporary sibling directory and renamed into place, so a failure leaves no
    half-written bundle. An existing bundle of the same problem at ``path`` is replaced; one of
    another problem only with ``force=True``; an existing file or non-empty directory that is
    not a bundle is refused (:func:`check_bundle_destination`).

    Raises:
        ValueError: ``path`` refused (see above) or not writable (the message names ``path``,
            never the temporary directory), or a required gradient is missing.
    """
    from safetensors.torch import save_file

    dest = Path(path)
    check_bundle_destination(dest, spec, force=force)
    tensors = {}
    for name in GRAD_FIELDS:
        t = getattr(grads, name)
        if t is None:
            if name in _REQUIRED_GRADS:
                raise ValueError(f"save_bundle: gradient {name} is missing")
            continue
        tensors[name] = t.detach().to("cpu").contiguous()
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    except OSError as exc:
        raise ValueError(f"{dest}: cannot write the bundle ({exc.strerror or exc})") from None
    try:
        save_file(tensors, str(tmp / GRADIENTS))
        manifest = {
            "format": BUNDLE_FORMAT,
            "version": BUNDLE_VERSION,
            "spec": spec.to_json(),
            "inputs_sha256": input_digests(problem),
            "gradients": {
                "file": GRADIENTS,
                "sha256": _file_sha256(tmp / GRADIENTS),
                "tensors": {k: {"dtype": str(v.dtype).replace("torch.", ""),
                                "shape": list(v.shape)} for k, v in tensors.items()},
            },
            "metadata": _jsonable(metadata),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, allow_nan=True) + "\n")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp made it private; a bundle is for sharing
        for name in (MANIFEST, GRADIENTS):
            os.chmod(tmp / name, 0o666 & ~umask)
        if dest.exists():
            old = dest.with_name(f".{dest.name}.old")
            if old.exists():
                shutil.rmtree(old)
            dest.rename(old)
            tmp.rename(dest)
            shutil.rmtree(old)
        else:
            tmp.rename(dest)
    except OSError as exc:  # the message names dest, not the temporary sibling
        raise ValueError(f"{dest}: cannot write the bundle ({exc.strerror or exc})") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _manifest_path(path: Path) -> Path:
    return path / MANIFEST if path.is_dir() else path


def is_bundle(path: str | os.PathLike) -> bool:
    """True when ``path`` is a bundle directory or its ``bundle.json``."""
    p = Path(path)
    return (p.is_dir() and (p / MANIFEST).is_file()) or (p.is_file() and p.name == MANIFEST)


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed, checked ``bundle.json`` of a bundle (no gradients read).

    Raises:
        ValueError: unreadable / not JSON / wrong format or version / missing fields; the
            message names the file.
    """
    mpath = _manifest_path(Path(path))
    try:
        text = mpath.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{mpath}: cannot read the bundle manifest: {exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{mpath}: not valid JSON (truncated or corrupt?): {exc}") from exc
    if not isinstance(data, dict) or data.get("format") != BUNDLE_FORMAT:
        raise ValueError(f"{mpath}: not a {BUNDLE_FORMAT} manifest")
    if data.get("version") != BUNDLE_VERSION:
        version = data.get("version")
        note = _VERSION_NOTES.get(version) if type(version) is int else None
        raise ValueError(
            f"{mpath}: bundle version {version!r}, this package reads version "
            f"{BUNDLE_VERSION}" + (f" ({note})" if note else "")
        )
    for key, kind in (("spec", dict), ("inputs_sha256", dict), ("gradients", dict),
                      ("metadata", dict)):
        if not isinstance(data.get(key), kind):
            raise ValueError(f"{mpath}: field {key!r} is missing or not a JSON object")
    g = data["gradients"]
    if g.get("file") != GRADIENTS or not isinstance(g.get("sha256"), str):
        raise ValueError(f"{mpath}: field 'gradients' must name {GRADIENTS} and its sha256")
    data["spec"] = ProblemSpec.from_json(data["spec"], where=str(mpath))
    return data


def load_bundle(
    path: str | os.PathLike, *, check_inputs: bool = True,
    problem: MoEBackwardProblem | None = None,
    routing_file: str | os.PathLike | None = None,
    weights_file: str | os.PathLike | None = None,
) -> Bundle:
    """Load a bundle: manifest, gradients (safetensors), and the input check.

    Args:
        path: the bundle directory (or its ``bundle.json``).
        check_inputs: re-create the problem on the CPU from the spec and compare every input
            digest (or compare with ``problem``'s digests when given).
        problem: an already built problem of the same spec (skips the re-creation).
        routing_file, weights_file: the files a real-input spec was made from (see
            :func:`build_problem`).
    Raises:
        ValueError: naming the file: unreadable, truncated or corrupt manifest or gradient file,
            a gradient file whose sha256 differs from the manifest's, missing or mis-shaped
            gradients, or input digests that differ from the re-created problem's.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    root = Path(path)
    if root.is_file():
        root = root.parent
    data = read_manifest(root)
    spec: ProblemSpec = data["spec"]
    gpath = root / GRADIENTS
    if not gpath.is_file():
        raise ValueError(f"{gpath}: the bundle's gradient file is missing")
    digest = _file_sha256(gpath)
    if digest != data["gradients"]["sha256"]:
        raise ValueError(
            f"{gpath}: sha256 {digest[:12]}... differs from the manifest's "
            f"{data['gradients']['sha256'][:12]}... (truncated, corrupt or replaced file)"
        )
    try:
        tensors = load_file(str(gpath))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{gpath}: not a readable safetensors file: {exc}") from exc
    T, H, I, E = spec.tokens, spec.hidden, spec.intermediate, spec.experts
    shapes = {
        "hidden_states_grad_TH": (T, H), "affinity_grad_TE": (T, E),
        "w_gate_up_grad_EH2I": (E, H, 2, I), "w_down_grad_EIH": (E, I, H),
        "b_gate_up_grad_E2I": (E, 2, I), "b_down_grad_EH": (E, H),
    }
    for name in _REQUIRED_GRADS:
        if name not in tensors:
            raise ValueError(f"{gpath}: gradient {name!r} is missing")
    unknown = sorted(set(tensors) - set(GRAD_FIELDS))
    if unknown:
        raise ValueError(f"{gpath}: unknown tensors {unknown}")
    for name, t in tensors.items():
        if tuple(t.shape) != shapes[name]:
            raise ValueError(
                f"{gpath}: gradient {name!r} has shape {list(t.shape)}, the spec gives "
                f"{list(shapes[name])}"
            )
        if not t.is_floating_point():
            raise ValueError(f"{gpath}: gradient {name!r} has non-float dtype {t.dtype}")
    grads = MoEGrads(**{k: tensors.get(k) for k in GRAD_FIELDS})
    grads.info["backend"] = data["metadata"].get("backend")
    digests = {str(k): str(v) for k, v in data["inputs_sha256"].items()}
    if check_inputs:
        if problem is None:
            try:
                problem = build_problem(spec, routing_file=routing_file,
                                        weights_file=weights_file)
            except ValueError as exc:
                raise ValueError(f"{root / MANIFEST}: cannot re-create its problem: {exc}") from exc
        check_digests(digests, input_digests(problem), where=str(root / MANIFEST))
    return Bundle(path=root, spec=spec, inputs_sha256=digests, grads=grads,
                  metadata=data["metadata"])


def check_digests(stored: dict[str, str], rebuilt: dict[str, str], where: str) -> None:
    """Raise ValueError naming ``where`` and every tensor whose digest differs."""
    names = sorted(set(stored) | set(rebuilt))
    bad = [n for n in names if stored.get(n) != rebuilt.get(n)]
    if bad:
        raise ValueError(
            f"{where}: input digests differ from the re-created problem for {bad}: the bundle "
            "was made from other inputs (another spec, package version, or a CPU that computes "
            "the seeded inputs differently); its gradients cannot be compared with this problem"
        )
