"""Offline PTX fingerprints of the CuTe DSL GEMM families: ``key -> sha256`` of the PTX, as JSON.

The acceptance tool of a refactor that must leave the kernels alone (issue 31): run it before
and after, then ``--diff`` the two files. No GPU needed (offline ``sm_90a`` / ``sm_100a``
compiles); CuTe DSL must be installed.

The families are found through the registry (``provider(arch, fmt, problem).load()``, wherever
the registry module lives), the keys built with each family module's own key constructors, so
the same script runs on either side of a move of the modules. The grid covers every family x
epilogue / output mode x major x arch:

- varlen-K (wgrad) ``sm90_bf16``: the YAML tiles and the speed variants x (majors, out dtype,
  accumulate, output mode, input order);
- ``sm90_mxfp8``: its sweep tiles x (elem, token layout, out dtype, accumulate, mode);
- ``sm100_bf16``: the YAML tiles x the offline tests' (majors, dtype, accumulate, mode, order);
- ``sm100_blockscaled``: mxfp8 / mxfp4 / nvfp4 x dtype x accumulate x mode;
- varlen-M (grouped_mm) ``sm90``: store / gated / dgated x tiles (cooperative, pingpong, 64-row)
  x gather / TMA A x W major x index dtype x side output x gpt-oss activation / bias; the store
  epilogue also with tile_n 192.

CuTe DSL names a kernel's ``.entry`` symbol after the kernel object: its class's module path
and qualname with the dots left out, then its arguments, cut at a fixed length
(``kernel_cutlass_kernel_cuda_kernelsgemmsm90grouped_mm_build_kernel_classlocals
Sm90GroupedMmKernel_object_at__CopyAtom_...``). A move of the module renames the symbol (and
changes how much of the arguments' part survives the cut) and nothing else, so the hash is taken
after every ``.entry`` name is replaced by ``<kernel>`` (its parameters stay numbered:
``<kernel>_param_3``): a refactor that moves the modules compares the code, not the name.
``--raw`` hashes the PTX as compiled.

Usage::

    python benchmarks/ptx_fingerprint.py --out /work/ptx_before.json [--only sm90_bf16,...]
    python benchmarks/ptx_fingerprint.py --diff /work/ptx_before.json /work/ptx_after.json
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import itertools
import json
import pathlib
import re
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # this checkout first

_REGISTRIES = ("cuda_kernels.gemm.registry", "cuda_kernels.grouped_wgrad.registry")
# before the varlen-M family had a registry row
_VARLEN_M_FALLBACK = "cuda_kernels.grouped_mm.sm90"


def _first_module(names):
    for name in names:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            continue
    raise ModuleNotFoundError(f"none of {names}")


def family(arch: str, fmt: str, problem: str = "varlen_k"):
    """The family module of (arch, fmt, problem), through the registry."""
    registry = _first_module(_REGISTRIES)
    row = registry.provider(arch, fmt, problem)
    if row is None and problem == "varlen_m":
        return importlib.import_module(_VARLEN_M_FALLBACK)
    return row.load()


def _key_name(key) -> str:
    return repr(key)


def sm90_bf16_keys():
    m = family("sm90", "bf16")
    T = m.Sm90TileConfig
    tiles = {cfg for _n, _c, cfg in m.load_sm90_tile_rules()}
    tiles |= {T(128, 128, 64, 5, True, epi_n=64),
              T(128, 128, 64, 6, True, acc_epilogue="l2prefetch"),
              T(128, 128, 64, 6, False, acc_epilogue="l2prefetch", epi_n=64, swizzle=4)}
    combos = [  # (a_major, b_major, out_dtype, accumulate, output_mode, input_order)
        ("m", "n", "bfloat16", False, "dense", "tensor2d"),
        ("k", "n", "float32", True, "dense", "tensor2d"),
        ("m", "k", "float16", False, "discrete", "tensor2d"),
        ("k", "k", "float32", True, "discrete", "tensor_ragged"),
    ]
    for tile, (am, bm, dt, acc, mode, order) in itertools.product(sorted(tiles, key=repr), combos):
        yield m.Sm90WgradKey(768, 768, 4, a_major=am, b_major=bm, out_dtype=dt, accumulate=acc,
                             output_mode=mode, input_order=order, tile=tile)
    for tile in sorted(tiles, key=repr):  # partial tiles (dense only)
        yield m.Sm90WgradKey(320, 200, 4, a_major="m", b_major="n", out_dtype="float32",
                             tile=tile)


def sm90_mxfp8_keys():
    m = family("sm90", "mxfp8")
    tiles = set(m.sweep_tile_configs(2048, 1536)) | set(m.sweep_tile_configs(256, 192))
    tiles |= {m.Sm90MxTileConfig(), m.Sm90MxTileConfig(64, 64)}
    combos = [  # (elem, token_layout, out_dtype, accumulate, output_mode)
        ("e4m3", "direct", "float32", False, "dense"),
        ("e5m2", "padded", "bfloat16", True, "dense"),
        ("e4m3", "padded", "bfloat16", True, "discrete"),
    ]
    for tile, (elem, lay, dt, acc, mode) in itertools.product(sorted(tiles, key=repr), combos):
        yield m.Sm90MxWgradKey(256, 256, 4, elem=elem, token_layout=lay, out_dtype=dt,
                               accumulate=acc, output_mode=mode, tile=tile)


def sm100_bf16_keys():
    m = family("sm100", "bf16")
    tiles = {cfg for _n, _c, cfg in m.load_sm100_tile_rules()}
    for mn in ((256, 256), (128, 128), (256, 128), (128, 64)):
        tiles.add(m.select_sm100_tile_config(512, 512, 4, mma_tiler_mn=mn))
    combos = [  # (a_major, b_major, out_dtype, accumulate, output_mode, input_order)
        ("m", "n", "bfloat16", False, "dense", "tensor2d"),
        ("k", "k", "float32", True, "dense", "tensor_ragged"),
        ("k", "n", "float16", True, "dense", "tensor2d"),
        ("m", "k", "float32", False, "discrete", "tensor_ragged"),
        ("m", "n", "float32", True, "discrete", "tensor2d"),
    ]
    for tile, (am, bm, dt, acc, mode, order) in itertools.product(sorted(tiles, key=repr), combos):
        yield m.Sm100WgradKey(512, 512, 4, a_major=am, b_major=bm, out_dtype=dt,
                              accumulate=acc, output_mode=mode, input_order=order, tile=tile)
    yield m.Sm100WgradKey(384, 320, 4, a_major="m", b_major="n",
                          tile=m.select_sm100_tile_config(384, 320, 4, mma_tiler_mn=(128, 64)))


def sm100_blockscaled_keys():
    m = family("sm100", "mxfp8")
    nv_tile = m.Sm100BsTileConfig(128, 128, 64, 8)
    fmts = [("mxfp8", "e4m3", None), ("mxfp8", "e5m2", None), ("mxfp4", "e2m1", None),
            ("nvfp4", "e2m1", nv_tile)]
    combos = [("float32", False, "dense"), ("bfloat16", True, "dense"),
              ("float16", False, "discrete"), ("float32", True, "discrete")]
    for (fmt, elem, tile), (dt, acc, mode) in itertools.product(fmts, combos):
        kw = {"tile": tile} if tile is not None else {}
        yield m.Sm100BlockScaledKey(512, 384, 4, fmt=fmt, elem=elem, out_dtype=dt,
                                    accumulate=acc, output_mode=mode, **kw)
    yield m.Sm100BlockScaledKey(384, 320, 3, elem="e5m2", out_dtype="bfloat16", accumulate=True)


def grouped_mm_sm90_keys():
    m = family("sm90", "bf16", "varlen_m")
    T, G = m.Sm90GroupedMmTile, m.GatedEpilogue
    tiles = [T(128, 256, 64, 4), T(128, 128, 64, 6), T(128, 128, 64, 6, pingpong=True),
             T(64, 256, 64, 4)]
    tiles += [cfg for _n, _c, cfg in m.load_grouped_mm_tile_rules() if cfg not in tiles]
    gpt_oss = G(1.702, 1.0, None, 7.0, -7.0, 7.0)
    for tile in tiles:
        for gather, w_major, index, rows in [
            (True, "n", "int64", False), (True, "k", "int32", True),
            (False, "k", "int64", False), (True, "n", "int64", True),
        ]:
            yield m.Sm90GroupedMmKey(2880, 2048, 16, gather_a=gather, w_major=w_major,
                                     index_dtype=index, write_a_rows=rows, tile=tile)
        for gated, rows in [(G(), False), (G(1.702, 1.0, None, 7.0, -7.0, 7.0, True), True)]:
            yield m.Sm90GroupedMmKey(5760, 2880, 32, epilogue="gated", gated=gated,
                                     write_a_rows=rows, tile=tile)
        for gated, w_major, rows in [(G(), "k", False), (gpt_oss, "k", True), (G(), "n", False)]:
            yield m.Sm90GroupedMmKey(2880, 2880, 32, w_major=w_major, epilogue="dgated",
                                     gated=gated, write_a_rows=rows, tile=tile)
    # tile_n 192 (the store epilogue; a pingpong 192 tile has no registers for the side
    # output: skipped)
    for tile in [T(128, 192, 64, 5), T(128, 192, 64, 5, True)]:
        for gather, w_major, index, rows in [
            (True, "n", "int64", False), (True, "k", "int32", True),
            (False, "k", "int64", False), (True, "n", "int64", True),
        ]:
            if rows and tile.pingpong and tile.tile_n > 176:
                continue
            yield m.Sm90GroupedMmKey(2880, 2048, 16, gather_a=gather, w_major=w_major,
                                     index_dtype=index, write_a_rows=rows, tile=tile)
    # partial K / N
    yield m.Sm90GroupedMmKey(2048, 1000, 16, index_dtype="int32", w_major="k", write_a_rows=True,
                             tile=T(128, 128, 64, 6, pingpong=True))
    yield m.Sm90GroupedMmKey(1000, 768, 8, tile=T(128, 256, 64, 4))


#: family -> (key generator, offline compile arch)
FAMILIES = {
    "sm90_bf16": (sm90_bf16_keys, "sm_90a"),
    "sm90_mxfp8": (sm90_mxfp8_keys, "sm_90a"),
    "sm100_bf16": (sm100_bf16_keys, "sm_100a"),
    "sm100_blockscaled": (sm100_blockscaled_keys, "sm_100a"),
    "grouped_mm_sm90": (grouped_mm_sm90_keys, "sm_90a"),
}


def _family_of_key(key):
    return importlib.import_module(type(key).__module__).FAMILY


def normalized(ptx: str) -> str:
    """``ptx`` with its kernels' ``.entry`` names replaced by ``<kernel>``."""
    for name in set(re.findall(r"\.entry\s+([\w$]+)", ptx)):
        ptx = ptx.replace(name, "<kernel>")
    return ptx


def fingerprint(only: list[str] | None = None, limit: int | None = None,
                raw: bool = False) -> dict:
    out: dict[str, dict[str, str]] = {}
    for name, (keys, arch) in FAMILIES.items():
        if only and name not in only:
            continue
        seen: dict[str, str] = {}
        t0 = time.time()
        for i, key in enumerate(dict.fromkeys(keys())):
            if limit is not None and i >= limit:
                break
            ptx = _family_of_key(key).offline_ptx(key, arch)
            if not raw:
                ptx = normalized(ptx)
            seen[_key_name(key)] = hashlib.sha256(ptx.encode()).hexdigest()
        out[name] = seen
        print(f"{name}: {len(seen)} keys, {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return out


def diff(before: dict, after: dict) -> int:
    """Print the per-family counts and every key whose hash changed / is missing; 0 if identical."""
    bad = 0
    for name in sorted(set(before) | set(after)):
        b, a = before.get(name, {}), after.get(name, {})
        changed = [k for k in b if k in a and a[k] != b[k]]
        missing = sorted(set(b) ^ set(a))
        state = "identical" if not changed and not missing else "DIFFERENT"
        print(f"{name}: {len(b)} before, {len(a)} after, {len(changed)} changed, "
              f"{len(missing)} only on one side: {state}")
        for k in changed + missing:
            print(f"   {k}")
        bad += len(changed) + len(missing)
    return 1 if bad else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the key -> sha256 JSON here")
    p.add_argument("--only", help="comma-separated families (default: all)")
    p.add_argument("--limit", type=int, help="at most this many keys per family (a smoke run)")
    p.add_argument("--raw", action="store_true", help="hash the PTX as compiled")
    p.add_argument("--list", action="store_true", help="print the key counts, compile nothing")
    p.add_argument("--diff", nargs=2, metavar=("BEFORE", "AFTER"))
    args = p.parse_args(argv)
    if args.diff:
        files = [json.loads(pathlib.Path(f).read_text()) for f in args.diff]
        return diff(*files)
    only = args.only.split(",") if args.only else None
    if args.list:
        for name, (keys, _arch) in FAMILIES.items():
            if not only or name in only:
                print(name, len(dict.fromkeys(keys())))
        return 0
    t0 = time.time()
    result = fingerprint(only, args.limit, args.raw)
    text = json.dumps(result, indent=1, sort_keys=True)
    if args.out:
        pathlib.Path(args.out).write_text(text)
    else:
        print(text)
    print(f"total {sum(map(len, result.values()))} keys, {time.time() - t0:.0f} s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
