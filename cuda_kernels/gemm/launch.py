"""The one compile-cache and launch layer of the grouped GEMM kernels, for every kernel family.

A kernel family (the varlen-K wgrad ``sm90_bf16``, ``sm100_bf16``, ``sm90_mxfp8``,
``sm100_blockscaled``; the varlen-M ``sm90_grouped_mm``) builds on a :class:`KernelFamily`: its
compile key (a frozen dataclass, the cache key) and its kernel (the CuTe DSL kernel object of a
key), plus the few hooks in which it really differs (a tile counter for a dynamic scheduler, a
launch gate, a no-token path, the arch of its runtime compile, its own operands and launch). This
layer owns the rest, once: the per-key compile cache and its count, the fake operands of a
compile (a symbolic ``tokens_sum``: new splits never recompile), the architecture pin of an
offline / cross compile, the offline PTX compile, and the launcher (``tensor_ragged`` repack
where the family does not address ragged operands in place, the descriptor workspace where the
family builds per-expert TMA descriptors, persistent grid size from occupancy, launch stream).

The API reaches a family only through ``registry.py`` (by module name); the formats map a static
contract to its family's key (``FAMILY.key_from_contract``) and cache the launcher per contract
(``bf16.load_launcher``).

No CuTe DSL import and no GPU query at import time: CuTe DSL is imported inside the compile
functions. This module imports nothing of the package.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import Any

from . import kernel_cache

__all__ = [
    "KernelFamily",
    "contract_key_fields",
    "cross_compile_kwargs",
    "fake_wgrad_operands",
    "key_of_contract",
    "pinned_cute_arch",
    "present_cuda_arch",
]

# ---------------------------------------------------------------------------------------------
# The kernel-family layer
# ---------------------------------------------------------------------------------------------


class KernelFamily:
    """One kernel family's host side: compile cache, offline compile and launcher.

    The family provides its key type and kernel; the hooks default to "not needed".

    Args:
        name: "sm90", "sm100", "sm90_grouped_mm", ...: names the family (``compile_name``).
        kernel: ``kernel(key)`` -> the CuTe DSL kernel object, called as ``kernel(a, b_NS,
            offsets, out, [tile_counter,] grid, stream)`` (a wgrad family; another takes its
            ``fake_operands``). A wgrad key is a frozen dataclass with the fields of
            :func:`contract_key_fields`, ``num_tiles`` and ``tile.cluster_shape_mn``.
        key_from_contract: ``WgradContract -> key`` (the tile from the contract's
            ``mma_tiler_mn``, else from ``configs/cuda``); raises ``ValueError`` when none fits.
        runtime_arch: ``() -> arch | None``: the target of the runtime compile, pinned
            (``"sm_100a"``), or None to compile for the present GPU without a pin.
        tile_counter: the kernel's dynamic scheduler takes a zeroed int32 ``[1]`` counter after
            ``out``; every launch allocates its own on the launch stream.
        gate: ``() -> reason | None``: why the kernel must not run (checked first at every
            launch; ``RuntimeError(reason)``, nothing launched nor written).
        prepare: ``(key, a, b, out, stream) -> (a, b) | None``: operands to launch, or None when
            the call is complete without a launch; called with the launch stream current.
        as_key: converts what ``launcher`` / ``offline_ptx`` accept into the key.
        ctas_per_sm: ``key -> int``: CTAs of the kernel that fit one SM at once (its shared
            memory / TMEM footprint); the persistent grid is :func:`resident_clusters` of it.
            Default 1 (both families size their pipelines to fill an SM's shared memory).
        fake_operands: ``key -> tuple``: the kernel's tensor arguments for a compile (before
            the CTA count and stream); default :func:`fake_wgrad_operands` (A, B, offsets, out)
            plus the tile counter when ``tile_counter``. Block-scaled families add their scales.
        counter_len: ``key -> int``: int32 words of the zeroed counter (default 1, the tile
            counter; a kernel that builds per-expert descriptors adds one flag per expert).
        workspace_bytes: ``key -> int``: bytes of the descriptor workspace the kernel takes
            after the stream (default 0: none). The launcher passes the caller's
            ``descriptor_workspace`` (checked: uint8, contiguous, 64-byte aligned, large
            enough) or allocates one per launch on the launch stream, as an int64 view of
            exactly this size.
        ragged_in_place: the kernel addresses ``tensor_ragged`` K-major operands in place
            (per-expert descriptors); otherwise the launcher repacks them (:func:`ragged_to_2d`).
        key_type: the key class; a launch / offline compile of anything else (after
            ``as_key``) raises ``ValueError``.
        launch: ``(key, compiled, *operands) -> None``: a family with its own operands (the
            varlen-M kernels) launches itself; default the wgrad launch (:meth:`_launch`).
        compile_name: names the compile in messages (default ``compile_<name>_wgrad``).
    """

    def __init__(
        self,
        name: str,
        kernel: Callable[[Any], Any],
        key_from_contract: Callable[[Any], Any],
        *,
        runtime_arch: Callable[[], str | None] = lambda: None,
        tile_counter: bool = False,
        gate: Callable[[], str | None] | None = None,
        prepare: Callable[..., tuple | None] | None = None,
        as_key: Callable[[Any], Any] = lambda key: key,
        ctas_per_sm: Callable[[Any], int] = lambda key: 1,
        fake_operands: Callable[[Any], tuple] | None = None,
        counter_len: Callable[[Any], int] = lambda key: 1,
        workspace_bytes: Callable[[Any], int] = lambda key: 0,
        ragged_in_place: bool = False,
        key_type: type | None = None,
        launch: Callable[..., None] | None = None,
        compile_name: str | None = None,
    ) -> None:
        self.name = name
        self.kernel = kernel
        self.key_from_contract = key_from_contract
        self.runtime_arch = runtime_arch
        self.tile_counter = tile_counter
        self.gate = gate
        self.prepare = prepare
        self.as_key = as_key
        self.ctas_per_sm = ctas_per_sm
        self.fake_operands = fake_operands
        self.counter_len = counter_len
        self.workspace_bytes = workspace_bytes
        self.ragged_in_place = ragged_in_place
        self.key_type = key_type
        self.launch = launch if launch is not None else self._launch
        self.compile_name = compile_name or f"compile_{name}_wgrad"
        #: Real (uncached) compiles in this process.
        self.compile_count = 0
        self._compiled: dict[Any, Any] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"KernelFamily({self.name!r})"

    def check_key(self, key: Any, fn_name: str | None = None) -> Any:
        """``as_key(key)``, checked (a ``key_type`` instance). Needs no CuTe DSL: a bad key gets
        its own error whether or not CuTe DSL is installed (its presence is checked by the
        compile itself, :meth:`_compile`).

        Raises:
            ValueError: not a key of this family (or what ``as_key`` refuses).
        """
        fn_name = fn_name or self.compile_name
        key = self.as_key(key)
        if self.key_type is not None and not isinstance(key, self.key_type):
            raise ValueError(f"{fn_name}: want a {self.key_type.__name__}, got {key!r}")
        return key

    def _require_cute(self, fn_name: str, gated: bool) -> None:
        """Raise ``RuntimeError`` when CuTe DSL is not installed: with the family's ``gate``
        reason when ``gated`` and it refuses (the real error of a launch), else naming the
        missing package."""
        if importlib.util.find_spec("cutlass") is not None:
            return
        reason = self.gate() if gated and self.gate is not None else None
        raise RuntimeError(
            reason or f"{fn_name} needs nvidia-cutlass-dsl==4.8.1 (pip install '.[cuda]')"
        )

    def _compile(self, key: Any, arch: str | None, dump_dir: str | None = None):
        """``cute.compile`` of ``key``'s kernel on fake operands: for the present GPU when ``arch``
        is None, else for ``arch`` with the DSL's arch pinned (keeping PTX in ``dump_dir``: an
        offline compile). Without CuTe DSL: ``RuntimeError``, the family's gate first for a
        runtime compile (no ``dump_dir``)."""
        offline = dump_dir is not None
        self._require_cute(self.compile_name + ("_offline" if offline else ""), not offline)
        import cutlass
        from cutlass import cute

        # tensor_ragged with a K-major operand has a per-expert row stride (K_e), not one TMA
        # descriptor: a family with ``ragged_in_place`` builds per-expert descriptors on the
        # device (in the descriptor workspace); otherwise the launcher repacks such operands
        # first (ragged_to_2d), so the compiled kernel is the tensor2d one.
        kernel = self.kernel(key)
        if self.fake_operands is not None:
            args = tuple(self.fake_operands(key))
        else:
            args = fake_wgrad_operands(key)
            if self.tile_counter:
                counter = cute.runtime.make_fake_compact_tensor(
                    cutlass.Int32, (self.counter_len(key),), assumed_align=4
                )
                args += (counter,)
        stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
        tail = ()
        ws_bytes = self.workspace_bytes(key)
        if ws_bytes:
            tail = (
                cute.runtime.make_fake_compact_tensor(
                    cutlass.Int64, (ws_bytes // 8,), assumed_align=_DESC_ALIGN
                ),
            )
        opts = "--enable-tvm-ffi"
        if arch is None:
            return cute.compile(kernel, *args, cutlass.Int32(1), stream, *tail, options=opts)
        opts += f" --gpu-arch {arch}"
        if dump_dir is not None:
            opts += f" --keep-ptx --dump-dir {dump_dir}"
        with pinned_cute_arch(arch):  # not the arch of whatever GPU is present
            return cute.compile(
                kernel,
                *args,
                cutlass.Int32(1),
                stream,
                *tail,
                options=opts,
                **cross_compile_kwargs(arch),
            )

    def compiled(self, key: Any):
        """The compiled kernel of ``key``: built once per process, loaded from the persistent
        kernel cache (:mod:`.kernel_cache`) when an earlier process compiled it
        (``compile_count`` counts the real compiles)."""
        with self._lock:
            fn = self._compiled.get(key)
            if fn is None:
                arch = self.runtime_arch()

                def compile_now():
                    built = self._compile(key, arch)
                    self.compile_count += 1  # a real compile (a cache load is not one)
                    return built

                fn = self._compiled[key] = kernel_cache.load_or_compile(
                    self.name, key, arch, compile_now
                )
            return fn

    def module_getattr(self, module_name: str) -> Callable[[str], Any]:
        """The family module's ``__getattr__``: ``COMPILE_COUNT`` is this family's count of real
        compiles (read it as ``<module>.COMPILE_COUNT``, as before the shared layer)."""

        def __getattr__(name: str) -> Any:
            if name == "COMPILE_COUNT":
                return self.compile_count
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")

        return __getattr__

    def cache_clear(self) -> None:
        """Forget the compiled kernels (tests)."""
        with self._lock:
            self._compiled.clear()

    def launcher(self, key: Any) -> Callable[..., None]:
        """The launcher of ``key`` (compiled once per key): a ``functools.partial`` of the
        family's ``launch`` whose ``args`` are ``(key, compiled kernel)``. The wgrad launch is
        ``launcher(a, b, offsets, out, stream=None, descriptor_workspace=None)``
        (``descriptor_workspace`` used only by a family with ``workspace_bytes``).

        Raises:
            ValueError: not a key of this family.
            RuntimeError: the family's gate refuses and CuTe DSL is not installed, CuTe DSL is
                not installed, or the compile fails (in that order; the gate is otherwise
                checked at each launch).
        """
        key = self.check_key(key)
        return functools.partial(self.launch, key, self.compiled(key))

    def offline_ptx(self, key: Any, arch: str) -> str:
        """Compile ``key`` for ``arch`` without a GPU (nothing loaded) and return the PTX text.

        Raises:
            ValueError: not a key of this family.
            RuntimeError: CuTe DSL is not installed or produced no PTX.
        """
        key = self.check_key(key, f"{self.compile_name}_offline")
        with tempfile.TemporaryDirectory(prefix=f"{self.name}_ptx_") as tmp:
            ptx = self._compile(key, arch, dump_dir=tmp).__ptx__
        if not ptx:
            raise RuntimeError(f"CuTe DSL produced no PTX for {key} on {arch}")
        return ptx

    def offline_compiler(self, default_arch: str) -> Callable[..., str]:
        """The family module's ``compile_<name>_wgrad_offline(key, arch=default_arch) -> str``:
        :meth:`offline_ptx` (what a key accepts: see the family's ``as_key``)."""

        def compile_offline(key: Any, arch: str = default_arch) -> str:
            return self.offline_ptx(key, arch)

        name = f"{self.compile_name}_offline"
        compile_offline.__name__ = compile_offline.__qualname__ = name
        compile_offline.__doc__ = (
            f"Compile ``key`` for ``arch`` (default ``{default_arch}``) without a GPU and return "
            "the generated PTX text (CI; nothing is loaded).\n\n    Raises:\n        "
            "RuntimeError: CuTe DSL is not installed or produced no PTX.\n        ValueError: "
            "the key is outside what the kernel is built for.\n    "
        )
        return compile_offline

    def _launch(
        self, key: Any, fn: Any, a, b, offsets, out, stream=None, descriptor_workspace=None
    ) -> None:
        """One launch, every step of it on the launch stream (``stream``, else the current one).

        The compiled kernel takes its stream from the TVM-FFI environment stream, i.e. torch's
        current stream, so the launch enters ``stream`` (:func:`on_stream`) BEFORE anything is
        enqueued or allocated: the family's ``prepare`` hook (zero stand-ins, zero fills), the
        ``tensor_ragged`` repack (families without ``ragged_in_place``), the tile counter, the
        descriptor workspace (when the caller gives none) and the kernel then run in stream
        order, and the temporaries (repacked operands, counter, workspace, stand-ins) are
        allocated on the stream that
        reads them, so the caching allocator reuses their blocks only after that stream's later
        work (what ``record_stream`` would arrange for a tensor allocated elsewhere). Inputs are
        read on the launch stream, as the kernel itself reads them: the caller orders their
        producers before it (the contract of ``current_stream`` in cuDNN's API).
        """
        if self.gate is not None:
            reason = self.gate()
            if reason is not None:
                raise RuntimeError(reason)
        with on_stream(stream):
            if self.prepare is not None:
                operands = self.prepare(key, a, b, out, stream)
                if operands is None:
                    return
                a, b = operands
            if key.input_order == "tensor_ragged" and not self.ragged_in_place:
                if key.a_major == "k":
                    a = ragged_to_2d(a, offsets, a.shape[0])
                if key.b_major == "k":
                    b = ragged_to_2d(b.t(), offsets, b.shape[1]).t()
            grid = self.grid_size(key, a.device)
            tail = ()
            ws_bytes = self.workspace_bytes(key)
            if ws_bytes:
                tail = (descriptor_workspace_view(descriptor_workspace, ws_bytes, a.device),)
            if self.tile_counter:
                fn(a, b.t(), offsets, out, self.counter_for(key, a.device), grid, *tail)
            else:
                fn(a, b.t(), offsets, out, grid, *tail)

    def counter_for(self, key: Any, device):
        """The dynamic scheduler's int32 ``[counter_len(key)]`` tile counter (and per-expert flags)
        of one launch (``tile_counter`` families): a zeroed one on the launch stream
        (:func:`_zeroed_counter`); a family whose kernel resets its counter overrides this."""
        return _zeroed_counter(device, self.counter_len(key))

    def grid_size(self, key: Any, device) -> int:
        """The persistent grid, in clusters: as many as can be resident at once
        (:func:`resident_clusters` of the SM count, the key's cluster and ``ctas_per_sm``), and
        no more than there are tiles."""
        cluster_ctas = key.tile.cluster_shape_mn[0] * key.tile.cluster_shape_mn[1]
        units = resident_clusters(device.index or 0, cluster_ctas, self.ctas_per_sm(key))
        return max(1, min(key.num_tiles, units))


def resident_clusters(device_index: int, cluster_ctas: int, ctas_per_sm: int = 1) -> int:
    """How many ``cluster_ctas``-CTA clusters of a kernel can be resident at once on a device.

    - ``cluster_ctas == 1``: ``SMs x ctas_per_sm`` (CUDA occupancy: the blocks per SM that
      shared memory, registers and threads allow times the SM count).
    - a real cluster, one CTA per SM: the CUDA driver's ``cuOccupancyMaxActiveClusters`` (a
      cluster's CTAs must sit in one GPC, so an odd GPC leaves an SM idle and the count can be
      below ``SMs // cluster_ctas``), queried the way CUTLASS's persistent Blackwell GEMMs size
      their grid: ``cutlass.utils.HardwareInfo().get_max_active_clusters(cluster_size)`` (a
      dummy kernel holding an SM's whole shared memory, i.e. one CTA per SM, as ours do), once
      per device and cluster size, never during CUDA-graph capture (module load).
    - otherwise, or where that query is unavailable: ``(SMs x ctas_per_sm) // cluster_ctas``
      (the GPC-blind bound; a non-resident cluster of a persistent kernel only starts late).
    """
    sms = num_sms(device_index)
    if cluster_ctas == 1:
        return max(1, sms * ctas_per_sm)
    if ctas_per_sm == 1:
        queried = _max_active_clusters(device_index, cluster_ctas)
        if queried:
            return queried
    return max(1, sms * ctas_per_sm // cluster_ctas)


_OCCUPANCY: dict[tuple[int, int], int] = {}


def _max_active_clusters(device_index: int, cluster_ctas: int) -> int | None:
    """``cuOccupancyMaxActiveClusters`` of a 1-CTA-per-SM kernel with ``cluster_ctas``-CTA
    clusters on ``device_index`` (through CUTLASS's ``HardwareInfo``), cached; None when it
    cannot be asked (no cuda-python driver bindings, capture in progress, a driver error)."""
    key = (device_index, cluster_ctas)
    if key in _OCCUPANCY:
        return _OCCUPANCY[key]
    import torch

    if torch.cuda.is_current_stream_capturing():
        return None  # the query loads a module: not while a graph is being captured
    try:
        from cutlass.utils import HardwareInfo

        with torch.cuda.device(device_index):
            value = int(HardwareInfo(device_index).get_max_active_clusters(cluster_ctas))
    except Exception:  # noqa: BLE001 - any failure falls back to the GPC-blind bound
        return None
    if value < 1:
        return None
    _OCCUPANCY[key] = value
    return value


def on_stream(stream):
    """Context in which ``stream`` (a ``torch.cuda.Stream``) is torch's current stream (and its
    device the current device); a no-op for None (the current stream is the launch stream)."""
    import torch

    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _zeroed_counter(device, length: int = 1):
    """A zeroed int32 ``[length]`` tile counter of a dynamic scheduler (and, past word 0, the
    per-expert descriptor flags of a kernel that builds descriptors), allocated and zeroed on
    the current (= launch) stream: each launch gets its own, so concurrent launches on
    different streams never share one, and no reset kernel is needed after a launch."""
    import torch

    return torch.zeros(length, dtype=torch.int32, device=device)


#: A TMA descriptor (CUtensorMap) is 128 bytes, aligned to 64 (CUDA driver API).
_DESC_ALIGN = 64


def descriptor_workspace_view(workspace, nbytes: int, device):
    """The int64 view of the first ``nbytes`` of the caller's ``descriptor_workspace`` (uint8,
    contiguous, on ``device``, 64-byte aligned: each 128-byte descriptor slot must be), or a
    fresh one allocated on the current (= launch) stream when ``workspace`` is None. The kernel
    rewrites every descriptor it uses at each launch, so nothing needs to persist.

    Raises:
        ValueError: the buffer is not uint8 / contiguous, too small, on another device, or
            not 64-byte aligned.
    """
    import torch

    if workspace is None:
        return torch.empty(nbytes // 8, dtype=torch.int64, device=device)
    if (
        not isinstance(workspace, torch.Tensor)
        or workspace.dtype != torch.uint8
        or not workspace.is_contiguous()
    ):
        raise ValueError("descriptor_workspace must be a contiguous torch.uint8 tensor")
    if workspace.numel() < nbytes:
        raise ValueError(
            f"descriptor_workspace holds {workspace.numel()} bytes; this kernel's per-expert "
            f"TMA descriptors need {nbytes}"
        )
    if workspace.device != torch.device(device):
        raise ValueError(
            f"descriptor_workspace is on {workspace.device}, the operands on {device}"
        )
    if workspace.data_ptr() % _DESC_ALIGN:
        raise ValueError(
            f"descriptor_workspace must be {_DESC_ALIGN}-byte aligned (TMA descriptors), got "
            f"address {workspace.data_ptr():#x}"
        )
    return workspace[:nbytes].view(torch.int64)


def contract_key_fields(contract: Any) -> dict[str, Any]:
    """The fields a kernel key shares with a ``WgradContract`` (every key field but ``tile``)."""
    return {
        "hidden": contract.hidden,
        "intermediate": contract.intermediate,
        "num_experts": contract.num_experts,
        "a_major": contract.a_major,
        "b_major": contract.b_major,
        "out_dtype": contract.out_dtype,
        "output_mode": contract.output_mode,
        "accumulate": contract.accumulate,
        "input_order": contract.input_order,
    }


def key_of_contract(key_cls: type, select: Callable[..., Any], contract: Any, **select_kw):
    """The ``key_cls`` compile key of a ``WgradContract``: its :func:`contract_key_fields` and
    the tile ``select(hidden, intermediate, num_experts, mma_tiler_mn=..., **select_kw)`` picks
    (the contract's ``mma_tiler_mn``, else the family's YAML rules).

    Raises:
        ValueError: no tile fits, or the key refuses the contract.
    """
    tile = select(
        contract.hidden, contract.intermediate, contract.num_experts,
        mma_tiler_mn=contract.mma_tiler_mn, **select_kw,
    )
    return key_cls(**contract_key_fields(contract), tile=tile)


def fake_wgrad_operands(key):
    """Fake (shape-only) ``a, b, offsets, out`` of a grouped wgrad key (SM90 or SM100: the same
    field names), with a symbolic ``tokens_sum`` so one compile serves every split."""
    import cutlass
    from cutlass import cute

    m, n = key.hidden, key.intermediate
    any_k_major = key.a_major == "k" or key.b_major == "k"
    s = cute.sym_int32(divisibility=8 if any_k_major else 1, symbol="tokens_sum")
    a = cute.runtime.make_fake_compact_tensor(
        cutlass.BFloat16,
        (m, s),
        stride_order=(1, 0) if key.a_major == "k" else (0, 1),
        assumed_align=16,
    )
    b = cute.runtime.make_fake_compact_tensor(
        cutlass.BFloat16,
        (n, s),
        stride_order=(1, 0) if key.b_major == "k" else (0, 1),
        assumed_align=16,
    )
    return (a, b, *fake_offsets_and_out(key))


def fake_offsets_and_out(key):
    """Fake ``offsets`` ([E] int32) and ``out`` (dense: [E, M, N] of ``key.out_dtype``;
    discrete: [E] int64 output addresses) of a grouped wgrad key, shared by every family's
    fake operands."""
    import cutlass
    from cutlass import cute

    out_t = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16, "float32": cutlass.Float32}
    m, n, e = key.hidden, key.intermediate, key.num_experts
    offsets = cute.runtime.make_fake_compact_tensor(cutlass.Int32, (e,), assumed_align=4)
    if key.output_mode == "dense":
        out = cute.runtime.make_fake_compact_tensor(
            out_t[key.out_dtype], (e, m, n), stride_order=(2, 1, 0), assumed_align=16
        )
    else:  # discrete: (E,) int64 output addresses
        out = cute.runtime.make_fake_compact_tensor(cutlass.Int64, (e,), assumed_align=8)
    return offsets, out


def ragged_to_2d(x_XS, offsets_E, k_major_rows: int):
    """Repack a ``tensor_ragged`` K-major operand into the tensor2d ``(rows, S)`` layout, on device
    (families without ``ragged_in_place``: SM90; it builds a ``(rows, S)`` int64 index tensor).

    ``x_XS`` is the caller's ``(rows, S)`` view whose storage holds per-expert ``(rows, K_e)``
    row-major blocks at element offset ``rows * begin_e``. No host read of ``offsets_E``.
    """
    import torch

    rows, s = x_XS.shape
    flat = torch.as_strided(x_XS, (rows * s,), (1,))
    if s == 0:
        return x_XS.new_empty((rows, 0)).as_strided((rows, 0), (0, 1))
    ends = offsets_E.to(torch.int64)
    begins = torch.cat([ends.new_zeros(1), ends[:-1]])
    counts = ends - begins
    col_expert = torch.repeat_interleave(
        torch.arange(ends.numel(), device=x_XS.device), counts, output_size=s
    )
    col = torch.arange(s, device=x_XS.device)
    local_k = col - begins[col_expert]  # (S,)
    base = rows * begins[col_expert] + local_k  # (S,)
    row = torch.arange(rows, device=x_XS.device)
    idx = base[None, :] + row[:, None] * counts[col_expert][None, :]
    return flat[idx]  # (rows, S) contiguous, K-major


def host_offset_ends(
    offsets, tokens_sum: int, *, arg: str, err: Callable[[str], Exception],
    even: bool = False,
) -> list[int]:
    """Read cumulative expert ends on the host (one device sync on CUDA) and check them:
    non-decreasing from >= 0, even where FP4 packs token pairs (``even``), the last equal to
    ``tokens_sum``. Shared by the quantizer entries, the block-scaled twin and the SM90 MXFP8
    entry; ``err(message)`` makes the caller's exception.

    Returns:
        The ends as Python ints.
    """
    ends = [int(v) for v in offsets.tolist()]
    prev = 0
    for e, end in enumerate(ends):
        if end < prev:
            raise err(f"{arg} must be non-decreasing and >= 0; {arg}[{e}] = {end} after {prev}")
        if even and end % 2:
            raise err(f"FP4 packs token pairs, so every offset must be even; {arg}[{e}] = {end}")
        prev = end
    if ends and ends[-1] != tokens_sum:
        raise err(f"{arg}[-1] = {ends[-1]} must equal tokens_sum = {tokens_sum}")
    return ends


@functools.lru_cache(maxsize=16)
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of CUDA device ``device_index`` (cached)."""
    import torch

    return torch.cuda.get_device_properties(device_index).multi_processor_count


# ---------------------------------------------------------------------------------------------
# The compile target: the architecture pin of an offline / cross compile
# ---------------------------------------------------------------------------------------------

#: One CuTe DSL compile at a time may pin the DSL's architecture (it is process-global state).
_ARCH_PIN_LOCK = threading.RLock()
_MISSING = object()


@contextlib.contextmanager
def pinned_cute_arch(arch: str) -> Iterator[None]:
    """Make CuTe DSL compile for ``arch`` (e.g. ``"sm_100a"``) whatever GPU is present; restore after.

    CuTe DSL takes the target of its arch checks (``BaseDSL.get_arch_enum``: tcgen05 / wgmma /
    TMA atoms built while tracing) from ``compile_options.gpu_arch`` and, where that is unset or
    read outside a compile, from ``envar.arch``: ``CUTE_DSL_ARCH`` or, without it, the compute
    capability of the GPU it finds (``sm_100`` when none). The execution-target check of the
    compile backend compares ``envar.arch`` with the compile target as well. An offline compile
    for another architecture than the present GPU's (``sm_100a`` on an H200) therefore pins
    ``envar.arch`` for the duration of the compile, besides passing ``--gpu-arch``; the previous
    value (including "not yet detected") is restored on exit, errors included. Pair it with
    :func:`cross_compile_kwargs` so that no JIT engine is built for a target the present GPU
    cannot run.
    """
    from cutlass.base_dsl.dsl import BaseDSL

    envar = BaseDSL._get_dsl().envar
    with _ARCH_PIN_LOCK:
        saved = envar.__dict__.get("_arch", _MISSING)
        envar.arch = arch
        try:
            yield
        finally:
            if saved is _MISSING:
                del envar.arch
            else:
                envar._arch = saved


def present_cuda_arch() -> str | None:
    """The CuTe DSL arch name of the current CUDA device (``"sm_90a"``, ``"sm_100a"``), or None
    without CUDA. A compile for another target builds no JIT engine (``cross_compile_kwargs``)."""
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}{'a' if major >= 9 else ''}"


def cross_compile_kwargs(arch: str) -> dict:
    """``cute.compile`` keywords for a compile targeting ``arch``: ``no_jit_engine=True`` unless
    the present GPU is that arch, so that a binary the present GPU cannot run (sm_100a on an
    H200, anything on a machine without GPU) is only compiled, never loaded."""
    return {} if present_cuda_arch() == arch else {"no_jit_engine": True}
