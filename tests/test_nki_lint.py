"""AST lint: the NKI kernel module is written in the NKI language subset (issue 11, item 1).

Sources (aws-neuron-sdk @ 81ce03ae): ``nki/get-started/nki-language-guide.rst`` (values: None,
bool, int, float, str, tensors; containers: tuples, lists, dicts with string keys, classes that
"must inherit from NKIObject and no other classes", enums; control flow: if / for / while;
functions inlined, nested functions and functions as values), ``nki/migration/index.rst`` (no
``is`` / ``is not``; no ``*`` in signatures; runtime loops through ``nl.fori_loop``). What the
guide does not list is rejected here: lambdas, comprehensions, try/raise, global/nonlocal,
yield/await, set literals, star-args, imports inside functions, and any host library (torch,
numpy) or host-side validation inside a function the kernel traces.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect

KERNEL_MODULE = importlib.import_module("nki_kernels.blockwise_mm_bwd_mxfp8")

ALLOWED_STMTS = (
    ast.FunctionDef, ast.ClassDef, ast.Return, ast.Delete, ast.Assign, ast.AugAssign,
    ast.AnnAssign, ast.For, ast.While, ast.If, ast.With, ast.Expr, ast.Pass, ast.Break,
    ast.Continue, ast.Assert,
)
FORBIDDEN_EXPRS = (
    ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.Set, ast.Yield,
    ast.YieldFrom, ast.Await, ast.Starred, ast.NamedExpr,
)
ALLOWED_BUILTINS = {
    "range", "len", "min", "max", "abs", "int", "float", "bool", "str", "tuple", "list", "dict",
    "enumerate", "zip", "divmod", "print", "reversed", "sum", "any", "all", "round",
}
HOST_NAMES = {"torch", "np", "numpy", "validate_blockwise_mm_bwd_args", "prepare_kernel_call",
              "getattr", "setattr", "hasattr", "isinstance", "type", "vars", "exec", "eval",
              "open", "__import__"}
# module-level imports the kernel module may have (host glue is imported lazily in _host_prepare)
ALLOWED_IMPORTS = {"__future__", "nki_kernels._nki", "nki_kernels.config"}
HOST_FUNCTIONS = {"_host_prepare"}  # runs on the host before tracing (the launcher's hook)


def _tree():
    return ast.parse(inspect.getsource(KERNEL_MODULE))


def _traced_functions(tree):
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name not in HOST_FUNCTIONS:
            yield node
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    yield item


def _violations(fn: ast.FunctionDef) -> list[str]:
    out = []
    where = f"{fn.name}"
    args = fn.args
    if args.vararg or args.kwarg or args.kwonlyargs:
        out.append(f"{where}: '*' / '**' in the signature (NKI migration guide)")
    for node in ast.walk(fn):
        line = f"{where}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.stmt) and not isinstance(node, ALLOWED_STMTS):
            out.append(f"{line}: statement {type(node).__name__} is not in the NKI subset")
        if isinstance(node, FORBIDDEN_EXPRS):
            out.append(f"{line}: {type(node).__name__} is not in the NKI subset")
        if isinstance(node, ast.Compare) and any(isinstance(o, (ast.Is, ast.IsNot))
                                                 for o in node.ops):
            out.append(f"{line}: 'is' / 'is not' (NKI: use == / !=)")
        if isinstance(node, ast.Constant) and isinstance(node.value, (bytes, complex)):
            out.append(f"{line}: {type(node.value).__name__} constant")
        if isinstance(node, ast.Dict):
            for k in node.keys:
                if not (isinstance(k, ast.Constant) and isinstance(k.value, str)):
                    out.append(f"{line}: dict keys must be strings (NKI language guide)")
        if isinstance(node, ast.Name) and node.id in HOST_NAMES:
            out.append(f"{line}: host name {node.id!r} in traced code")
        if isinstance(node, ast.Attribute) and node.attr in ("numpy", "__dict__", "__class__"):
            out.append(f"{line}: host attribute .{node.attr} in traced code")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            name = node.func.id
            if hasattr(builtins, name) and name not in ALLOWED_BUILTINS:
                out.append(f"{line}: builtin {name}() is not in the NKI subset")
        if isinstance(node, ast.With):
            for item in node.items:
                call = item.context_expr
                ok = isinstance(call, ast.Call) and (
                    (isinstance(call.func, ast.Name) and call.func.id == "region")
                    or (isinstance(call.func, ast.Attribute) and call.func.attr == "no_reorder")
                )
                if not ok:
                    out.append(f"{line}: 'with' only for region()/nl.no_reorder()")
    return out


def test_kernel_module_uses_only_the_nki_language_subset():
    tree = _tree()
    problems = []
    for fn in _traced_functions(tree):
        problems += _violations(fn)
    assert not problems, "\n".join(problems)


def test_kernel_module_imports_only_nki_and_its_config():
    for node in _tree().body:
        if isinstance(node, ast.Import):
            bad = [a.name for a in node.names]
            raise AssertionError(f"module-level 'import {', '.join(bad)}' in the kernel module")
        if isinstance(node, ast.ImportFrom):
            assert node.module in ALLOWED_IMPORTS, f"kernel module imports {node.module}"
        assert isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef,
                                 ast.Assign, ast.AnnAssign, ast.Expr)), (
            f"module-level {type(node).__name__} at line {node.lineno}"
        )


def test_kernel_classes_derive_from_nkiobject_only():
    """Guide, Class Support: 'the class must inherit from NKIObject and no other classes'."""
    tree = _tree()
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef)]
    assert classes
    for cls in classes:
        assert len(cls.bases) == 1 and ast.unparse(cls.bases[0]) == "nl.NKIObject", cls.name
    # the config types that cross the kernel boundary
    from nki_kernels._nki import nl
    from nki_kernels.config import KernelClampLimits, MatmulMxfp8KernelConfig, SkipMode

    for c in (KernelClampLimits, MatmulMxfp8KernelConfig, SkipMode):
        assert c.__bases__ == (nl.NKIObject,), c


def test_lint_catches_violations():
    src = '''
def k(x, *rest):
    if x is None:
        return [i for i in range(3)]
    try:
        y = torch.zeros(3)
    except Exception:
        raise ValueError("no")
    z = lambda a: a
    with open("f"):
        pass
    return getattr(x, "ap")
'''
    fn = ast.parse(src).body[0]
    msgs = "\n".join(_violations(fn))
    for frag in ("'*' / '**'", "'is' / 'is not'", "ListComp", "Try", "Raise", "'torch'",
                 "Lambda", "'with' only", "builtin getattr()"):
        assert frag in msgs, (frag, msgs)
