"""Launching kernels on the interpreter: ``simulate``, ``jit``, ``region``.

``simulate(kernel, lnc=1, target="trn3")(*args, **kwargs)`` runs the kernel eagerly on CPU:

* NumPy arrays and torch tensors become HBM tensors that SHARE the caller's memory when they are
  C-contiguous and writable (as AWS's simulator, writes to inputs land in place); other Python
  values pass through unchanged.
* ``lnc=2`` runs two program instances (``nl.program_id(0)`` 0 and 1) on two threads with private
  SBUF/PSUM/``private_hbm``, shared HBM (inputs and in-kernel ``shared_hbm`` allocations, matched by
  allocation order), a 2-party ``core_barrier`` and ``sendrecv`` mailboxes. An error in one
  instance breaks the barrier and is re-raised from the call.
* Returned HBM tensors (any nesting of tuples/lists) come back as NumPy copies, or torch tensors
  when any torch tensor came in. They must live in ``nl.shared_hbm`` (AWS rule).
* After each call ``.last_profile`` holds the :class:`~nki_kernels.interp.profile.Profile`.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np

from . import core as _core
from . import dtypes as _dt
from .core import NkiError, NkiTensor, ProgramContext, SharedState
from .profile import Profile

__all__ = ["Kernel", "Simulated", "jit", "region", "simulate"]

_TORCH_TO_NKI = {
    "torch.bfloat16": _dt.bfloat16, "torch.float32": _dt.float32, "torch.float16": _dt.float16,
    "torch.int32": _dt.int32, "torch.int16": _dt.int16, "torch.int8": _dt.int8,
    "torch.uint8": _dt.uint8, "torch.bool": _dt.bool_, "torch.float8_e4m3fn": _dt.float8_e4m3fn,
    "torch.float8_e5m2": _dt.float8_e5m2, "torch.float8_e8m0fnu": _dt.float8_e8m0fnu,
    "torch.uint32": _dt.uint32, "torch.uint16": _dt.uint16,
}
_RAW = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def _torch_to_np(t):
    """(numpy array sharing memory when possible, NKI dtype)."""
    import torch

    name = str(t.dtype)
    if name not in _TORCH_TO_NKI:
        raise ValueError(f"simulate: torch dtype {t.dtype} has no NKI equivalent")
    dt = _TORCH_TO_NKI[name]
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    if name in ("torch.bool",):
        arr = t.view(torch.uint8).numpy()
    elif t.dtype.is_floating_point and name not in ("torch.float32", "torch.float16"):
        raw = {1: torch.uint8, 2: torch.int16}[t.element_size()]
        arr = t.view(raw).numpy().view(_dt.np_dtype(dt))
    else:
        arr = t.numpy()
    return arr, dt


def _np_to_torch(a: np.ndarray, dtype: str):
    import torch

    a = np.ascontiguousarray(a)
    tname = {v: k for k, v in _TORCH_TO_NKI.items()}.get(dtype)
    if dtype in (_dt.float8_e4m3fn_x4, _dt.float8_e5m2_x4):
        return torch.from_numpy(a.view(np.int32)).view(torch.uint32)
    if dtype == _dt.float4_e2m1fn_x4:
        return torch.from_numpy(a.view(np.int16)).view(torch.uint16)
    if tname is None:
        return torch.from_numpy(a.view(_RAW[a.dtype.itemsize]))
    tdt = getattr(torch, tname.split(".")[1])
    if a.dtype.kind == "V" or a.dtype.name in ("bfloat16",) or "float8" in a.dtype.name:
        return torch.from_numpy(a.view(_RAW[a.dtype.itemsize])).view(tdt)
    return torch.from_numpy(a).view(tdt) if a.dtype.kind != "b" else torch.from_numpy(a)


class Simulated:
    """Callable returned by :func:`simulate`; ``.last_profile`` after each call."""

    def __init__(self, kernel, lnc=1, target="trn3", timeout_s=600.0):
        if isinstance(kernel, Kernel):
            lnc = kernel.lnc if lnc == 1 else lnc
            kernel = kernel.fn
        if lnc not in (1, 2):
            raise ValueError(f"simulate: lnc must be 1 or 2, got {lnc}")
        if target not in _core.TARGETS:
            raise ValueError(f"simulate: target must be one of {sorted(_core.TARGETS)}, got "
                             f"{target!r}")
        self.kernel = kernel
        self.lnc = lnc
        self.target = target
        self.timeout_s = timeout_s
        self.last_profile: Profile | None = None

    def _wrap_args(self, args, kwargs):
        any_torch = False
        buffer = _core.shared_hbm

        def conv(x, name):
            nonlocal any_torch
            if isinstance(x, NkiTensor):
                return x
            if _is_torch(x):
                any_torch = True
                arr, dt = _torch_to_np(x)
                return _core.wrap_array(arr, dt, buffer, name)
            if isinstance(x, np.ndarray):
                arr = x if (x.flags.c_contiguous and x.flags.writeable) else np.array(x)
                dt = _dt.normalize(arr.dtype)
                return _core.wrap_array(arr, dt, buffer, name)
            return x

        a2 = tuple(conv(x, f"arg{i}") for i, x in enumerate(args))
        k2 = {k: conv(v, k) for k, v in kwargs.items()}
        return a2, k2, any_torch

    def __call__(self, *args, **kwargs):
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # one BLAS thread per program instance (2 threads on a shared
        # 2-core machine ran the Qwen3 shape 6x slower: OpenMP threads spin on a busy core)
        try:
            return self._call(args, kwargs)
        finally:
            torch.set_num_threads(threads)

    def _call(self, args, kwargs):
        prepare = getattr(self.kernel, "host_prepare", None)
        if prepare is not None:  # host-side validation / conversion, before tracing
            args, kwargs = prepare(tuple(args), dict(kwargs))
        for i, x in enumerate(args):
            check_kernel_argument(f"argument {i}", x)
        for k, x in kwargs.items():
            check_kernel_argument(k, x)
        a2, k2, any_torch = self._wrap_args(args, kwargs)
        profile = Profile(self.target)
        shared = SharedState(self.lnc, timeout_s=self.timeout_s)
        if self.lnc == 1:
            ctx = ProgramContext(target=self.target, program_id=0, num_programs=1,
                                 shared=shared, profile=profile)
            ctx.launched = True
            profile.memory[0] = ctx
            prev = _core.set_current(ctx)
            try:
                out = self.kernel(*a2, **k2)
            finally:
                _core.set_current(prev)
        else:
            results = [None, None]
            errors = [None, None]

            def run(pid):
                ctx = ProgramContext(target=self.target, program_id=pid, num_programs=2,
                                     shared=shared, profile=profile)
                ctx.launched = True
                profile.memory[pid] = ctx
                _core.set_current(ctx)
                try:
                    results[pid] = self.kernel(*a2, **k2)
                    # a core that returns can no longer meet the other at a barrier/sendrecv
                    shared.barrier.abort(f"core {pid} returned; the cores' core_barrier/sendrecv "
                                         "calls differ")
                except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                    errors[pid] = e
                    shared.barrier.abort(f"core {pid} failed: {type(e).__name__}")
                finally:
                    _core.set_current(None)

            threads = [threading.Thread(target=run, args=(p,), name=f"nki-core{p}")
                       for p in (0, 1)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            real = [e for e in errors
                    if e is not None and not isinstance(e, _core.NkiBarrierError)]
            if real:
                raise real[0]
            for e in errors:
                if e is not None:
                    raise e
            out = results[0]
        profile.memory = {c: {"sbuf_peak_bytes": x.sbuf_peak, "psum_peak_banks": x.psum_banks_peak,
                              "sbuf_peak_by_region": dict(x.sbuf_peak_by_region)}
                          for c, x in profile.memory.items()}
        self.last_profile = profile
        return _convert_out(out, any_torch)


_PLAIN = (type(None), bool, int, float, str)


def check_kernel_argument(name, x):
    """Kernel arguments NKI accepts (SDK nki-language-guide "Class Support", migration guide):
    tensors (NumPy / torch / ours), None, bool, int, float, str (dtypes are strings), enum
    members, tuples of these, functions, and instances of classes derived from ``NKIObject``
    ("the class must inherit from NKIObject and no other classes"); lists must be tuples
    ("Replace list kernel arguments with tuples").

    Raises:
        NkiError: naming the argument and the rule.
    """
    import enum
    import types

    from .language import NKIObject

    if isinstance(x, (NkiTensor, np.ndarray, *_PLAIN, enum.Enum, types.FunctionType)) or _is_torch(x):
        return
    if isinstance(x, tuple):
        for i, v in enumerate(x):
            check_kernel_argument(f"{name}[{i}]", v)
        return
    if isinstance(x, list):
        raise NkiError(f"kernel {name}: a list argument; NKI takes tuples (SDK migration guide: "
                       "'Replace list kernel arguments with tuples')")
    bases = [NKIObject]
    try:  # the real NKI's base, when installed
        from nki_kernels._nki import HAVE_REAL_NKI
        from nki_kernels._nki import nl as _nl

        if HAVE_REAL_NKI:
            bases.append(_nl.NKIObject)
    except ImportError:  # pragma: no cover
        pass
    if not isinstance(x, tuple(bases)):
        raise NkiError(f"kernel {name}: {type(x).__module__}.{type(x).__qualname__} does not "
                       "derive from nl.NKIObject (SDK language guide, Class Support: 'the class "
                       "must inherit from NKIObject and no other classes')")
    for k, v in vars(x).items():  # the compiler copies the object's __dict__ in
        if not isinstance(v, NKIObject):
            check_kernel_argument(f"{name}.{k}", v)


def _convert_out(out, to_torch):
    if isinstance(out, NkiTensor):
        if out.buffer is not _core.shared_hbm:
            raise NkiError(f"kernel returned {out!r}; return tensors must be allocated in "
                           "nl.shared_hbm")
        # tensors allocated by the kernel are handed out without a copy (nothing else holds their
        # storage once the launch is over); views of the caller's inputs are copied
        a = out.numpy() if out.storage.owner_core == -1 else out._np()
        return _np_to_torch(a, out.dtype) if to_torch else a
    if isinstance(out, tuple):
        return tuple(_convert_out(o, to_torch) for o in out)
    if isinstance(out, list):
        return [_convert_out(o, to_torch) for o in out]
    return out


def simulate(kernel, *, lnc=1, target="trn3", timeout_s=600.0) -> Simulated:
    """Return a callable that runs ``kernel`` on the CPU interpreter.

    Args:
        kernel: a plain function written against ``nl``/``nisa`` or a :func:`jit` kernel
            (``kernel[2]`` selects LNC2).
        lnc: 1, or 2 for two program instances (LNC2).
        target: "trn3" (default, NeuronCore-v4, MX instructions) or "trn2".
        timeout_s: seconds a core waits at a barrier / sendrecv before failing.

    Raises:
        ValueError: bad ``lnc``/``target``.
    """
    return Simulated(kernel, lnc=lnc, target=target, timeout_s=timeout_s)


class Kernel:
    """What :func:`jit` returns: ``kernel(*args)`` runs LNC1, ``kernel[2](*args)`` LNC2."""

    def __init__(self, fn, lnc=1, target="trn3"):
        self.fn = fn
        self.lnc = lnc
        self.target = target
        self.__wrapped__ = fn
        self.__name__ = getattr(fn, "__name__", "kernel")
        self.__doc__ = getattr(fn, "__doc__", None)

    def __getitem__(self, lnc):
        if isinstance(lnc, tuple):
            if len(lnc) != 1:
                raise ValueError("only a 1-D launch grid is supported")
            lnc = lnc[0]
        if int(lnc) not in (1, 2):
            raise ValueError(f"launch grid {lnc}: LNC degree must be 1 or 2")
        return Kernel(self.fn, int(lnc), self.target)

    def __call__(self, *args, **kwargs):
        if _core.in_kernel():
            return self.fn(*args, **kwargs)  # called from inside a kernel: inline
        sim = Simulated(self.fn, lnc=self.lnc, target=self.target)
        out = sim(*args, **kwargs)
        self.last_profile = sim.last_profile
        return out


def jit(fn=None, **kwargs):
    """``@nki.jit``: wraps a kernel for the interpreter (keyword options are ignored)."""
    if fn is None:
        return lambda f: Kernel(f)
    return Kernel(fn)


@contextlib.contextmanager
def region(name: str):
    """Attribute the interpreter's work counters inside the block to region ``name``."""
    ctx = _core.current()
    _end_segment(ctx)
    ctx.region_stack.append(str(name))
    ctx.note_region_sbuf()
    try:
        yield
    finally:
        _end_segment(ctx)
        ctx.region_stack.pop()


def _end_segment(ctx) -> None:
    """Entering or leaving a region ends the open time-model segment (profile.py docstring)."""
    seg = getattr(ctx, "_seg_open", None)
    if seg is not None:
        seg.close_segment()
        ctx._seg_open = None
