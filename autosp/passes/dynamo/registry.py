"""The op-rule registry of the sequence-sharding analysis, and arguments bound by the ops' schemas.

Note [Op rule registry]
Each rule lives in the module of its op family (pointwise, views, reductions,
matmul, indexing, random, attention, positions, higher-order ops, factories and
collectives) and is registered there by one decorator that names its class:

    @rule("token-local: elementwise", "add", "mul", ..., targets=(some_callable,))
    def pointwise(an, gm, node): ...

The names are what Dynamo records: a Tensor method's name, a torch function's or
an ``operator`` builtin's ``__name__`` (one rule per name: a second registration
raises at import).  Lookup order: ``targets`` by identity (attention calls,
``operator.getitem``), then ``when=`` predicates in registration order (AutoSP's
collectives, higher-order operators; a family that needs to claim particular
nodes of an op another family names, e.g. a routing ``topk``, uses a predicate),
then names.  The class
is what the compile report lists for the op, so the table, the report and the
rules are one source.  `autosp.passes.dynamo.rules` imports every family module
(its FAMILIES tuple) and applies the table; a new family registers its rules the
same way and is added to that tuple.

Rules read arguments by name through `arguments` (bound by the op's schema, so
``x.norm(2, 1)``, ``torch.norm(x, p=2, dim=1)`` and ``x.norm(dim=1)`` all give
``dim=1``), never by position.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx
from torch.fx.operator_schemas import get_signature_for_torch_op

from autosp.passes.dynamo.placements import Partial, Shard
from autosp.passes.graph_utils import fake_value

FIX_GENERIC = ("AutoSP cannot make this exact under sequence parallelism: compute it per token, move it out of "
               "the compiled model, or train this model without sequence parallelism (sp_size=1)")


@dataclass(frozen=True)
class OpRule:
    """One rule: the function, the class the report shows for the ops it handles, and its family module."""

    fn: Callable
    op_class: str
    family: str

    def __call__(self, an, gm: fx.GraphModule, node: fx.Node):
        return self.fn(an, gm, node)


class _Table:
    """Op name or target -> rule.  Filled at import time by `rule`; read-only afterwards."""

    def __init__(self):
        self.by_name: dict[str, OpRule] = {}
        self.by_target: dict[object, OpRule] = {}
        self.by_predicate: list[tuple[Callable[[fx.Node], bool], OpRule]] = []

    def add(self, entry: OpRule, names, targets, when) -> None:
        for name in names:
            if name in self.by_name:
                raise ValueError(f"op {name!r} has two sequence-sharding rules: {self.by_name[name].fn.__qualname__} "
                                 f"and {entry.fn.__qualname__}")
            self.by_name[name] = entry
        for target in targets:
            self.by_target[target] = entry
        if when is not None:
            self.by_predicate.append((when, entry))


TABLE = _Table()


def rule(op_class: str, *names: str, targets=(), when: Callable[[fx.Node], bool] | None = None):
    """Register the decorated ``fn(an, gm, node) -> placement`` for ``names`` / ``targets`` under ``op_class``.

    ``when`` is a predicate for ops found by kind rather than by name (e.g. every higher-order operator)."""

    def register(fn: Callable) -> Callable:
        TABLE.add(OpRule(fn, op_class, fn.__module__.rsplit(".", 1)[-1]), names, targets, when)
        return fn

    return register


def op_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    return getattr(node.target, "__name__", str(node.target))


def lookup(node: fx.Node) -> OpRule | None:
    if node.op not in ("call_function", "call_method"):
        return None
    if node.op == "call_function":
        try:
            found = TABLE.by_target.get(node.target)
        except TypeError:  # unhashable target
            found = None
        if found is not None:
            return found
    for when, entry in TABLE.by_predicate:
        if when(node):
            return entry
    return TABLE.by_name.get(op_name(node))


def names_of(fn: Callable) -> frozenset[str]:
    """The op names registered for the rule function ``fn`` (for a family that handles the same ops in its own
    placements, e.g. the MoE rows: `autosp.passes.dynamo.moe`)."""
    return frozenset(name for name, entry in TABLE.by_name.items() if entry.fn is fn)


def op_table() -> dict[str, str]:
    """op name -> rule class, for documentation and tests."""
    return {name: entry.op_class for name, entry in sorted(TABLE.by_name.items())}


# ---------------------------------------------------------------------------------------------
# Arguments by schema
# ---------------------------------------------------------------------------------------------
def _is_tensor(value) -> bool:
    return isinstance(fake_value(value), torch.Tensor)


def _fits(annotation, value) -> bool:
    """Whether ``value`` (a graph argument) can be passed where the schema expects ``annotation``."""
    if annotation is inspect.Parameter.empty or value is None:
        return True
    text = str(annotation)
    if isinstance(value, (list, tuple)):
        if not any(w in text for w in ("List", "list", "Tuple", "tuple", "Sequence", "[]")):
            return False
        return all(_is_tensor(v) for v in value) == ("Tensor" in text) if value else True
    if _is_tensor(value):
        return "Tensor" in text
    tensor_only = text in ("Tensor", "<class 'torch.Tensor'>", "Optional[Tensor]", "typing.Optional[torch.Tensor]")
    if tensor_only:
        return False
    concrete = fake_value(value)
    if isinstance(concrete, bool):
        return "bool" in text or "umber" in text or "Scalar" in text
    if isinstance(concrete, (int, torch.SymInt)):
        return any(w in text for w in ("int", "umber", "Scalar", "float")) and text not in ("bool", "<class 'bool'>")
    if isinstance(concrete, (float, torch.SymFloat)):
        return any(w in text for w in ("float", "umber", "Scalar"))
    if isinstance(concrete, str):
        return "str" in text
    return True


def _schema_signature(schema) -> inspect.Signature:
    params, kind = [], inspect.Parameter.POSITIONAL_OR_KEYWORD
    for arg in schema.arguments:
        if arg.kwarg_only:
            kind = inspect.Parameter.KEYWORD_ONLY
        default = arg.default_value if arg.has_default_value() else inspect.Parameter.empty
        params.append(inspect.Parameter(arg.name, kind, default=default, annotation=str(arg.type)))
    return inspect.Signature(params)


def _signatures(node: fx.Node) -> list[inspect.Signature]:
    """Candidate signatures of the called op, most specific first."""
    return _find_signatures(node.op, node.target)


def _find_signatures(kind: str, target) -> list[inspect.Signature]:
    if kind == "call_method":
        method = getattr(torch.Tensor, str(target), None)
        found = []
        if method is not None and not inspect.isbuiltin(method) and not isinstance(method, type(torch.Tensor.add)):
            try:
                found.append(inspect.signature(method))
            except (TypeError, ValueError):
                pass
        function = getattr(torch, str(target), None)
        if callable(function):
            found += _function_signatures(function)
        packet = getattr(torch.ops.aten, str(target), None)
        if packet is not None and not found:
            found += [_schema_signature(getattr(packet, o)._schema) for o in packet.overloads()]
        return found
    if isinstance(target, torch._ops.OpOverload):
        return [_schema_signature(target._schema)]
    return _function_signatures(target)


def _function_signatures(fn) -> list[inspect.Signature]:
    try:
        return [inspect.signature(fn)]
    except (TypeError, ValueError):
        pass
    try:
        return list(get_signature_for_torch_op(fn) or [])
    except Exception:  # noqa: BLE001 - ops torch has no schema for are bound positionally below
        return []


def _bind(signature: inspect.Signature, args, kwargs, check: bool) -> dict | None:
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return None
    if check and not all(_fits(signature.parameters[name].annotation, value)
                         for name, value in bound.arguments.items()
                         if signature.parameters[name].kind not in (inspect.Parameter.VAR_POSITIONAL,
                                                                    inspect.Parameter.VAR_KEYWORD)):
        return None
    bound.apply_defaults()
    return dict(bound.arguments)


def arguments(node: fx.Node) -> dict[str, object]:
    """The node's arguments by name, bound by its op's schema (``self`` is called ``input``).

    Overloads are told apart by the kinds of the values (``torch.max(x, 1)`` vs ``torch.max(a, b)``).
    Tensor methods spelt with varargs (``x.permute(0, 2, 1)``, ``x.view(2, 3)``) bind as one list.
    Ops with no schema bind their positional arguments as ``arg0, arg1, ...``."""
    args, kwargs = tuple(node.args), dict(node.kwargs)
    signatures = _signatures(node)
    attempts = [(args, True), (args, False)]
    if node.op == "call_method" and len(args) > 2 and all(not isinstance(a, (list, tuple)) for a in args[1:]):
        attempts.insert(1, ((args[0], tuple(args[1:])), True))
    for call_args, check in attempts:
        for signature in signatures:
            bound = _bind(signature, call_args, kwargs, check)
            if bound is not None:
                if "self" in bound and "input" not in bound:
                    bound = {("input" if k == "self" else k): v for k, v in bound.items()}
                if "input" not in bound and bound:  # the first operand, whatever the schema calls it
                    bound["input"] = next(iter(bound.values()))
                return bound
    fallback = {f"arg{i}": a for i, a in enumerate(args)}
    if args:
        fallback["input"] = args[0]
    fallback.update(kwargs)
    return fallback


def argument(node: fx.Node, *names: str, default=None):
    """The first of ``names`` that the op's schema binds (aliases: ``dim``/``dims``, ``p``/``ord``)."""
    bound = arguments(node)
    for name in names:
        if name in bound:
            return bound[name]
    return default


# ---------------------------------------------------------------------------------------------
# Helpers the rules share
# ---------------------------------------------------------------------------------------------
def tensor_args(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes if _is_tensor(a)]


def ndim(node) -> int:
    value = fake_value(node)
    return value.dim() if isinstance(value, torch.Tensor) else 0


def shape(node) -> tuple:
    value = fake_value(node)
    return tuple(value.shape) if isinstance(value, torch.Tensor) else ()


def sharded_inputs(an, node) -> list[tuple[fx.Node, object]]:
    return [(a, an.of(a)) for a in tensor_args(node) if isinstance(an.of(a), (Shard, Partial))]


def multi(node, placement):
    """``placement`` for every output of a multi-output op (a single placement otherwise)."""
    value = fake_value(node)
    if isinstance(value, (tuple, list)):
        return tuple(placement for _ in value)
    return placement
