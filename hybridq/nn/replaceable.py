"""Can a module be swapped for a hybridq module without losing behaviour? One check for every swap that conversion
does (nn.Linear -> hybridq.nn.Linear, RMSNorm -> hybridq.nn.RMSNorm).

The replacement takes over the module's parameters (the same Parameter objects, so parameter hooks, optimizer
state and tied weights carry over), its training flag and its plain instance attributes (`carry_over`), and computes
the base class's forward. Anything else the module does or owns would be dropped, so the module is kept instead and
the reason reported (`replacement_blocker`): a class that overrides the base's methods (a LoRA-style `forward`),
parameters, buffers or submodules the replacement does not take, a parametrized parameter
(torch.nn.utils.parametrize), module hooks, `Module.compile()`. A module whose owner (its parent or another ancestor)
reads its parameters itself instead of calling it (nn.MultiheadAttention's `out_proj`, a fused inference fast path)
is kept too (`direct_readers`): the replacement's forward would not run there. Such reads are found in the source of
the ancestor's `forward` and of the methods it calls on itself.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap

import torch.nn as nn
from torch.nn.utils import parametrize

# what subclasses commonly redefine without changing what a built module computes
_HARMLESS_OVERRIDES = frozenset({
    "__init__", "__dict__", "__weakref__", "__repr__", "extra_repr", "reset_parameters", "_get_name"})
_HOOKS = {  # nn.Module attribute -> what registers it
    "_forward_pre_hooks": "forward pre-hooks",
    "_forward_hooks": "forward hooks",
    "_backward_pre_hooks": "backward pre-hooks",
    "_backward_hooks": "backward hooks",
    "_state_dict_pre_hooks": "state_dict pre-hooks",
    "_state_dict_hooks": "state_dict hooks",
    "_load_state_dict_pre_hooks": "load_state_dict pre-hooks",
    "_load_state_dict_post_hooks": "load_state_dict post-hooks",
}
_MODULE_ATTRS = frozenset(vars(nn.Module()))  # nn.Module's own bookkeeping (set up by every replacement)
# reading these from a parameter does not use its value
_METADATA = frozenset({"dtype", "device", "shape", "ndim", "requires_grad", "is_cuda", "is_meta", "layout", "size",
                       "dim", "numel", "is_sparse", "is_nested", "names"})


def replacement_blocker(module: nn.Module, base: type[nn.Module], takes: tuple[str, ...], replacement: str,
                        allowed_overrides: frozenset[str] = frozenset()) -> str | None:
    """Why `module` cannot be replaced by `replacement` (its description) without losing behaviour; None if it can.
    `base`: the class whose forward the replacement reproduces; `takes`: the parameter names the replacement takes
    over; `allowed_overrides`: methods a subclass may redefine because the caller checks them otherwise (a probe)."""
    if parametrize.is_parametrized(module):
        names = ", ".join(module.parametrizations.keys())
        return (f"its {names} is parametrized (torch.nn.utils.parametrize); {replacement} would freeze the computed "
                f"value and drop parametrizations.{names}.original")
    base_names = {n for c in base.__mro__ for n in vars(c)}
    for c in type(module).__mro__:
        if c in base.__mro__:
            break
        over = sorted(n for n, v in vars(c).items() if n in base_names and _behaviour(n, v)
                      and n not in _HARMLESS_OVERRIDES | allowed_overrides)
        if over:
            return (f"its class {c.__qualname__} overrides {base.__name__}.{', '.join(over)}, which {replacement} "
                    f"would not run")
    missing = [n for n in takes if n not in module._parameters]
    if missing:
        return f"its {', '.join(missing)} is not a registered parameter"
    owned = [f"parameter {n!r}" for n in module._parameters if n not in takes]
    owned += [f"buffer {n!r}" for n in module._buffers]
    owned += [f"submodule {n!r}" for n in module._modules]
    if owned:
        return f"it owns {', '.join(owned)}, which {replacement} would drop"
    hooks = [what for attr, what in _HOOKS.items() if getattr(module, attr, None)]
    if hooks:
        return f"it has {', '.join(hooks)}, which {replacement} would not run"
    if vars(module).get("_compiled_call_impl") is not None:
        return f"it was compiled with Module.compile(), which {replacement} would bypass"
    return None


def _behaviour(name: str, value) -> bool:
    """Whether a class attribute can change what a built module does: methods and descriptors, and the state_dict
    version (class data such as `__constants__` or the `__slotnames__` that copy/pickle caches cannot)."""
    return callable(value) or hasattr(type(value), "__get__") or name == "_version"


def carry_over(module: nn.Module, new: nn.Module, standard: frozenset[str], replacement: str) -> str | None:
    """Give `new` (not installed yet) `module`'s training flag and the instance attributes a user or library set on
    it (e.g. a tag read by an init function); `standard`: the attributes the replacement sets up itself. Returns why
    that is impossible (an attribute the replacement has too), with `new` unchanged; None once done."""
    extra = [n for n in vars(module) if n not in standard and n not in _MODULE_ATTRS and n != "_compiled_call_impl"]
    clash = sorted(n for n in extra if n in vars(new) or hasattr(type(new), n))
    if clash:
        return f"its attribute(s) {', '.join(clash)} would be replaced by {replacement}'s own"
    for n in extra:
        vars(new)[n] = vars(module)[n]
    new.train(module.training)
    return None


def direct_readers(model: nn.Module) -> dict[str, str]:
    """{fqn: why} of every module of `model` whose parameters an ancestor's forward reads itself (as values: reading
    `.dtype`, `.shape`, ... or comparing with None does not count), so that its own forward may not run."""
    found: dict[str, tuple[str, str, list[str]]] = {}
    for fqn, mod in model.named_modules():  # (parents before children: the nearest reader is named)
        mine: dict[str, tuple[str, str, list[str]]] = {}
        for chain, method in _forward_reads(type(mod)):
            path, pname = ".".join(chain[:-1]), chain[-1]
            try:
                target = mod.get_submodule(path)
            except AttributeError:
                continue
            if pname in target._parameters:
                full = f"{fqn}.{path}" if fqn else path
                mine.setdefault(full, (method, path, []))[2].append(pname)
        found.update(mine)
    return {full: (f"{method} reads self.{path}.{'/'.join(sorted(names, key=_weight_first))} itself instead of "
                   f"calling self.{path}, so the forward of {full} may not run (a replacement would be bypassed)")
            for full, (method, path, names) in found.items()}


def _weight_first(name: str) -> tuple[bool, str]:
    return name != "weight", name


@functools.lru_cache(maxsize=4096)  # (bounded: parametrize and fully_shard make classes per module)
def _forward_reads(cls: type) -> tuple[tuple[tuple[str, ...], str], ...]:
    """(attribute chain off self, e.g. ("out_proj", "weight"), "Class.method") of every value read of a chain of at
    least two attributes in `cls.forward` and the methods it calls on self, transitively."""
    reads: dict[tuple[str, ...], str] = {}
    todo, seen = ["forward"], set()
    while todo:
        name = todo.pop()
        func = inspect.getattr_static(cls, name, None)
        if not inspect.isfunction(func) or func in seen or func.__module__ == nn.Module.__module__:
            continue  # (nn.Module's own machinery reads no submodule's parameters)
        seen.add(func)
        chains, calls = _function_reads(func)
        for chain in chains:
            reads.setdefault(chain, func.__qualname__)
        todo += calls
    return tuple(reads.items())


@functools.lru_cache(maxsize=4096)  # (bounded: parametrize and fully_shard make classes per module)
def _function_reads(func) -> tuple[tuple[tuple[str, ...], ...], tuple[str, ...]]:
    """(attribute chains off the function's first argument read as values, names called as methods of it). A function
    without source (built-in, REPL) gives nothing."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    except (OSError, TypeError, SyntaxError):
        return (), ()
    fdef = tree.body[0] if tree.body else None
    if not isinstance(fdef, (ast.FunctionDef, ast.AsyncFunctionDef)) or not fdef.args.args:
        return (), ()
    me = fdef.args.args[0].arg
    parent = {c: n for n in ast.walk(fdef) for c in ast.iter_child_nodes(n)}
    chains, calls = set(), set()
    for node in ast.walk(fdef):
        if not isinstance(node, ast.Attribute) or not isinstance(node.ctx, ast.Load):
            continue
        chain = _chain(node, me)
        if chain is None:
            continue
        up = parent.get(node)
        if len(chain) == 1:
            if isinstance(up, ast.Call) and up.func is node:
                calls.add(chain[0])
        elif not _metadata_use(node, up):
            chains.add(chain)
    return tuple(sorted(chains)), tuple(sorted(calls))


def _chain(node: ast.Attribute, me: str) -> tuple[str, ...] | None:
    """("a", "b") for `me.a.b`, None if the expression does not start at the name `me`."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return tuple(reversed(attrs)) if isinstance(node, ast.Name) and node.id == me else None


def _metadata_use(node: ast.AST, up: ast.AST | None) -> bool:
    if isinstance(up, ast.Attribute) and up.attr in _METADATA:
        return True
    if isinstance(up, ast.Compare) and all(isinstance(op, (ast.Is, ast.IsNot)) for op in up.ops):
        return True
    return (isinstance(up, ast.Call) and isinstance(up.func, ast.Name) and up.func.id in ("isinstance", "type")
            and node in up.args)
