"""NKI dtype names as plain strings, and their NumPy storage types.

In the public NKI stub (``nki/api/nki/language/__init__.py``) ``DType = str`` and each dtype is a
module constant; nki-library compares dtypes by string (NKI_API.md §2.1). We do the same: every
constant below is a ``str`` equal to its name, so ``nl.bfloat16 == "bfloat16"``.

Storage: every interpreter tensor lives in a byte buffer; :func:`np_dtype` gives the NumPy dtype
used to view those bytes. Packed MX data types (``*_x4``) are stored as their raw 32-bit (fp8) or
16-bit (fp4) words; ``float8_e8m0fnu`` through ``ml_dtypes``; ``bool_`` as ``uint8``;
``tfloat32`` as ``float32``.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = [
    "ALL_DTYPES",
    "bfloat16",
    "bool_",
    "float4_e2m1fn_x4",
    "float8_e4m3",
    "float8_e4m3fn",
    "float8_e4m3fn_x4",
    "float8_e5m2",
    "float8_e5m2_x4",
    "float8_e8m0fnu",
    "float16",
    "float32",
    "int8",
    "int16",
    "int32",
    "is_float",
    "is_int",
    "is_x4",
    "itemsize",
    "normalize",
    "np_dtype",
    "tfloat32",
    "uint8",
    "uint16",
    "uint32",
]

bool_ = "bool_"
int8 = "int8"
int16 = "int16"
int32 = "int32"
uint8 = "uint8"
uint16 = "uint16"
uint32 = "uint32"
float16 = "float16"
bfloat16 = "bfloat16"
tfloat32 = "tfloat32"
float32 = "float32"
float8_e4m3 = "float8_e4m3"
float8_e4m3fn = "float8_e4m3fn"
float8_e5m2 = "float8_e5m2"
float8_e8m0fnu = "float8_e8m0fnu"
float8_e4m3fn_x4 = "float8_e4m3fn_x4"
float8_e5m2_x4 = "float8_e5m2_x4"
float4_e2m1fn_x4 = "float4_e2m1fn_x4"

_NP = {
    bool_: np.dtype(np.uint8),
    int8: np.dtype(np.int8),
    int16: np.dtype(np.int16),
    int32: np.dtype(np.int32),
    uint8: np.dtype(np.uint8),
    uint16: np.dtype(np.uint16),
    uint32: np.dtype(np.uint32),
    float16: np.dtype(np.float16),
    bfloat16: np.dtype(ml_dtypes.bfloat16),
    tfloat32: np.dtype(np.float32),
    float32: np.dtype(np.float32),
    float8_e4m3: np.dtype(ml_dtypes.float8_e4m3),
    float8_e4m3fn: np.dtype(ml_dtypes.float8_e4m3fn),
    float8_e5m2: np.dtype(ml_dtypes.float8_e5m2),
    float8_e8m0fnu: np.dtype(ml_dtypes.float8_e8m0fnu),
    float8_e4m3fn_x4: np.dtype(np.uint32),
    float8_e5m2_x4: np.dtype(np.uint32),
    float4_e2m1fn_x4: np.dtype(np.uint16),
}
ALL_DTYPES = tuple(_NP)

_INT = frozenset({bool_, int8, int16, int32, uint8, uint16, uint32})
_X4 = frozenset({float8_e4m3fn_x4, float8_e5m2_x4, float4_e2m1fn_x4})

# NumPy / torch spellings accepted as input (normalized to the NKI name).
_ALIASES = {
    "bool": bool_, "float": float32, "half": float16, "bf16": bfloat16, "fp32": float32,
    "float8_e4m3fn_x4": float8_e4m3fn_x4,
}
for _name, _dt in _NP.items():
    if _name not in _X4 and _name not in (tfloat32, bool_):
        _ALIASES.setdefault(_dt.name, _name)


def normalize(dtype) -> str:
    """Return the NKI dtype name (a ``str``) for ``dtype``.

    Accepts an NKI name (``nl.bfloat16``), a NumPy / ml_dtypes dtype or scalar type, or a torch
    dtype (``torch.bfloat16``).

    Raises:
        ValueError: ``dtype`` names no NKI dtype.
    """
    if isinstance(dtype, str):
        if dtype in _NP:
            return dtype
        if dtype in _ALIASES:
            return _ALIASES[dtype]
        raise ValueError(f"dtype: {dtype!r} is not an NKI dtype (one of {sorted(_NP)})")
    s = str(dtype)
    if s.startswith("torch."):
        return normalize(s[len("torch."):])
    try:
        return normalize(np.dtype(dtype).name)
    except TypeError:
        raise ValueError(f"dtype: {dtype!r} is not an NKI dtype") from None


def np_dtype(dtype) -> np.dtype:
    """NumPy dtype that stores one element of NKI dtype ``dtype`` (x4 types: the packed word)."""
    return _NP[normalize(dtype)]


def itemsize(dtype) -> int:
    """Bytes per element of NKI dtype ``dtype`` (4 for the fp8 x4 words, 2 for fp4 x4)."""
    return _NP[normalize(dtype)].itemsize


def is_int(dtype) -> bool:
    """True for integer and boolean dtypes (bitvec operands)."""
    return normalize(dtype) in _INT


def is_x4(dtype) -> bool:
    """True for the packed MX data dtypes (fp8 / fp4 ``*_x4``)."""
    return normalize(dtype) in _X4


def is_float(dtype) -> bool:
    """True for unpacked floating-point dtypes."""
    d = normalize(dtype)
    return d not in _INT and d not in _X4
