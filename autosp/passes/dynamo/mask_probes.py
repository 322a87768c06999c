"""Evaluate a model's mask subgraph as if its shard sat at another offset of the sequence.

Note [Mask probes at other offsets]
A mask built from an in-graph ``arange(L)`` (a shard of L tokens) sees token
indices 0..L-1 on every rank; the single-device program saw the whole sequence's.
A mask whose indices matter beyond their differences — chunked attention,
``q // C == k // C`` — shows on the shard's own block only the chunks that fall
inside it: with C a multiple of L aligned to the shards every block looks causal.
So the mask pass (Note [Attention masks built from the inputs]) evaluates the
subgraph with every such arange *shifted* to an offset ``o``: its values become
``o..o+L-1``, i.e. the block of tokens [o, o+L) of the whole sequence.

- The token indices are the subgraph's ``arange(0, L, 1)`` (shifted by o) and
  running counts ``cumsum`` of L copies of a constant c (shifted by c·o, as Note
  [Positions built in the graph] shifts them); an arange of L values that is not
  0..L-1, or token indices built another way from constants (``linspace``, a
  ``cumprod``), cannot be shifted and is refused.
- Values that are a shifted arange through views and the addition of constants
  (HF's ``kv_idx = arange(L)[None, None, None, :]``) are shift-equivariant; used as
  an index into the probe inputs (``padding_mask[b, kv_idx]``) they are shifted
  back, since a probe input of L tokens stands for the tokens [o, o+L).  An index
  computed from a token arange any other way is refused (the probes could not
  say which token it reads).
- Everything else computes on the shifted values as the model does.

The offsets step by L-1 over the whole (padded) sequence, so every token index
but the first is inside some probed block, after its predecessor: every chunk
border is seen.  A block shows pairs of tokens less than L apart; a mask that
reads no probe input through an index and separates no documents by position is
also probed with *gaps*: its token indices set to the sequence's first L/2 tokens
followed by L/2 tokens further on, at every distance up to the sequence's length
(a window or chunk longer than a shard, learnt nowhere else, shows there).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from autosp.errors import AutoSPError
from autosp.passes.dynamo.positions import arange_bounds, constant_fill
from autosp.passes.graph_utils import fake_value, module_name, source_location

_INDEX_LIKE = {"cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "linspace", "logspace"}
"""Ops that build token indices from constants in a way a shift cannot follow."""
_VIEWS = {"view", "reshape", "unsqueeze", "expand", "expand_as", "flatten", "squeeze", "contiguous", "clone", "to",
          "type", "long", "int", "float", "getitem"}
"""Ops that keep a shifted arange shifted (getitem with a basic index only)."""
_SHIFTS = {"add", "sub"}
"""With a constant operand: still shifted by the same offset."""
_INDEX_OPERANDS = {"getitem": (1, None), "gather": (2, "index"), "index_select": (2, "index"),
                   "take_along_dim": (1, "indices"), "take": (1, "index")}
"""Indexing ops: (position, keyword) of the operand that holds indices."""
_FIX = ("build the mask's token indices with torch.arange(seq_len) (or from position_ids), as Hugging Face does; "
        "see Note [Mask probes at other offsets]")


def _op(node: fx.Node) -> str:
    if node.op == "call_method":
        return node.target
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target)).removeprefix("__").removesuffix("__")
    return ""


def _nodes_in(tree) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(tree, found.append)
    return found


def _index_step(node: fx.Node, length: int) -> float | None:
    """How much a token index source grows per token: 1 for ``arange(L)``, c for a running count of c's, else
    None."""
    if _op(node) == "arange":
        return 1 if arange_bounds(node) == (0, length, 1) else None
    if _op(node) == "cumsum" and node.args and len(node.all_input_nodes) == 1:
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
        return constant_fill(node.args[0], length) if dim in (0, -1) else None
    return None


def _index_operand(node: fx.Node):
    op = _op(node)
    if op not in _INDEX_OPERANDS:
        return None
    position, keyword = _INDEX_OPERANDS[op]
    if keyword is not None and keyword in node.kwargs:
        return node.kwargs[keyword]
    return node.args[position] if len(node.args) > position else None


class IndexFlow:
    """Which nodes of a mask subgraph are token aranges, shifted values, and indices into the probe inputs."""

    def __init__(self, module: fx.GraphModule, length: int, where: str):
        self.token: dict[fx.Node, float] = {}
        """Token index sources -> how much they grow per token (an arange 1, a running count of c's: c)."""
        shifted: set[fx.Node] = set()
        derived: set[fx.Node] = set()
        constant: set[fx.Node] = set()
        self.indices: dict[fx.Node, set[fx.Node]] = {}
        """Indexing node -> the shifted nodes it uses as indices (shifted back when it runs)."""
        for node in module.graph.nodes:
            inputs = node.all_input_nodes
            if node.op == "placeholder" or node.op == "output":
                continue
            step = _index_step(node, length)
            if all(n in constant for n in inputs):
                constant.add(node)
                if step is None:
                    self._refuse_unshiftable(node, length, where)
            if step is not None:
                self.token[node] = step
                derived.add(node)
                if step == 1:  # an index into the probe inputs only with one token per step
                    shifted.add(node)
                continue
            if any(n in derived for n in inputs):
                derived.add(node)
            index = _index_operand(node)
            index_nodes = [n for n in (_nodes_in(index) if index is not None else []) if n in derived]
            if index_nodes:  # an index into the probe inputs: shifted back when it runs
                data = node.args[0] if node.args else None
                if not all(n in shifted for n in index_nodes) or data in index_nodes:
                    raise AutoSPError(
                        f"module {where}{source_location(node)} indexes a tensor at token indices computed from "
                        f"an in-graph arange ({_op(node)}) in its attention mask, which AutoSP cannot check at "
                        f"other shard offsets; {_FIX}")
                self.indices[node] = set(index_nodes)
                if data in shifted:  # a shifted table read at the block's tokens: still shifted
                    shifted.add(node)
            elif self._keeps_shift(node, shifted, derived):
                shifted.add(node)

    def moved(self, mapping: dict[fx.Node, fx.Node]) -> IndexFlow:
        """The same flow over a copy of its program (`resized_program`'s node map)."""
        moved = object.__new__(IndexFlow)
        moved.token = {mapping[n]: step for n, step in self.token.items()}
        moved.indices = {mapping[n]: {mapping[i] for i in used} for n, used in self.indices.items()}
        return moved

    @staticmethod
    def _refuse_unshiftable(node: fx.Node, length: int, where: str) -> None:
        op = _op(node)
        value = fake_value(node)
        tokens = isinstance(value, torch.Tensor) and length in tuple(value.shape)
        if op in _INDEX_LIKE and tokens or (op == "arange" and tokens and arange_bounds(node) != (0, length, 1)):
            raise AutoSPError(
                f"module {module_name(node)}{source_location(node)} builds token indices for its attention mask "
                f"with {op} from constants; on a shard they restart at 0 and AutoSP cannot shift them to the "
                f"shard's offset (module {where}); {_FIX}")

    @staticmethod
    def _keeps_shift(node: fx.Node, shifted: set[fx.Node], derived: set[fx.Node]) -> bool:
        op, args = _op(node), node.args
        if not args or not isinstance(args[0], fx.Node):
            return False
        if op in _VIEWS:
            return args[0] in shifted and not any(n in derived for n in _nodes_in((args[1:], node.kwargs)))
        if op in _SHIFTS and len(args) == 2 and not node.kwargs:
            first, second = args
            return first in shifted and not isinstance(second, fx.Node) or (
                op == "add" and second in shifted and not isinstance(first, fx.Node))
        return False


class ShiftedProgram:
    """A mask subgraph run with its token aranges shifted by ``shift`` (see the Note): an offset, or one per token
    (a gap probe: no index into the inputs may then read them).  Built once as a graph of its own, whose last input
    is the shift: each token index source is followed by ``+ step * shift``, each index into the probe inputs
    preceded by ``- shift`` (thousands of probes at long context run it as generated code, not node by node)."""

    def __init__(self, module: fx.GraphModule, flow: IndexFlow):
        graph = fx.Graph()
        mapping: dict[fx.Node, fx.Node] = {}
        nodes = list(module.graph.nodes)
        for node in [n for n in nodes if n.op == "placeholder"]:
            mapping[node] = graph.node_copy(node)
        shift = graph.placeholder("shift")  # after the program's own inputs
        for node in [n for n in nodes if n.op != "placeholder"]:
            mapping[node] = graph.node_copy(node, lambda n: mapping[n])
        shifted: dict[fx.Node, fx.Node] = {}
        for token, step in flow.token.items():
            source = mapping[token]
            with graph.inserting_after(source):
                scaled = graph.call_function(operator.mul, (shift, step))
            with graph.inserting_after(scaled):
                moved = graph.call_function(operator.add, (source, scaled))
            source.replace_all_uses_with(moved, delete_user_cb=lambda user, moved=moved: user is not moved)
            shifted[source] = moved
        for node, used in flow.indices.items():
            target = mapping[node]
            for index in {shifted.get(mapping[x], mapping[x]) for x in used}:
                with graph.inserting_before(target):
                    back = graph.call_function(operator.sub, (index, shift))
                target.replace_input_with(index, back)
        self.module = fx.GraphModule(module, graph)

    def run(self, args: list, shift: int | torch.Tensor):
        return self.module(*args, shift)


def gap_indices(length: int, seq_len: int) -> list[torch.Tensor]:
    """Token indices of gap probes: the first L/2 tokens of the sequence and L/2 further on, at every distance up to
    the sequence's (see the Note)."""
    head = max(1, length // 2)
    first = torch.arange(head)
    return [torch.cat([first, start + torch.arange(length - head)])
            for start in range(head, seq_len - (length - head) + 1, max(1, length - 1))]


def probe_offsets(length: int, seq_len: int) -> list[int]:
    """Offsets of the probed blocks of ``length`` tokens in a sequence of ``seq_len`` (see the Note)."""
    if seq_len <= length:
        return [0]
    step = max(1, length - 1)
    offsets = list(range(0, seq_len - length + 1, step))
    if offsets[-1] != seq_len - length:
        offsets.append(seq_len - length)
    return offsets


# Note [Mask programs probed on shorter blocks]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A probe of the mask program as traced is an [L, L] block: at long context (65,536 tokens a rank: 4.3e9 booleans
# a block, over P + 1 offsets and P blocks of the real batch) learning the mask costs more than the step.  What the
# probes ask (which pairs of tokens may attend) does not need blocks as long as the shard: the program is run
# *resized* to blocks of B tokens (``AutoSPConfig.mask_probe_tokens``), at offsets stepping by B - 1 over the whole
# sequence, so its cost is O(S * B) instead of O(S * L).
#
# The traced program has the length in it as integers (``arange(L)``, ``expand(.., L, L)``, ``x[:, :L]``).  Each
# integer equal to L is classified by what it does, not by the op's name: the op is run again on meta tensors of
# its traced shapes with that one integer changed; when the output's shape changes (or the op refuses the new size
# where it ran with the traced one) it is a size, and becomes B.  An integer equal to L that changes only values (a chunk or a window of exactly L tokens, a
# bound compared with indices) cannot be told from a constant, so the program is not resized (probed at L, as
# before, with a warning).  The resized program is then run on probe inputs of B tokens and every node's shape must
# be its traced shape with each L made B and nothing else changed; otherwise it is not resized either.  B is picked
# so that it equals no integer or dimension of the program (a coincidence would make that check blind).
#
# What the rule claims is then learnt from B-token blocks: pairs of tokens less than B apart at every offset
# (every chunk border, every window shorter than B), and the real batch is checked on B-token blocks stepping by
# B - 1 (every pair of neighbours, every pair less than B apart), not on each rank's whole block.  A window the
# configuration names is probed on blocks longer than it, and a mask the short blocks refuse (a window longer than
# B built in the graph, which the gap probes see) is learnt again on the shard before it is refused
# (`autosp.passes.dynamo.masks`).  What stays the learnt rule's, as pairs further than a shard apart did before:
# pairs further than B apart in a mask the gap probes cannot reach (one that indexes its inputs at token indices or
# separates documents by position), i.e. a window longer than B that is built in the graph of such a mask and
# named by no configuration.
#
# A mask learnt on the shard's own block (a program that is not resized, or one the short blocks refuse) costs
# what it did before: O(S * L) time and a few [L, L] blocks at once.  That is seconds on shards of thousands of
# tokens and out of reach on shards of hundreds of thousands (210 GB of booleans a probe at 458,752 tokens), where
# a rank would run out of memory or compile for hours instead of saying why.  So it is done only on shards of at
# most ``SHARD_PROBE_BLOCKS`` x ``mask_probe_tokens`` tokens (32,768 by default: 1 GiB of booleans a probe) and
# refused beyond, naming what kept the program from being resized; a user who wants it anyway raises
# ``mask_probe_tokens`` to the shard's length.

SHARD_PROBE_BLOCKS = 64
"""A mask is learnt on the shard's own block only when the shard has at most this many times ``mask_probe_tokens``
tokens (Note [Mask programs probed on shorter blocks])."""


class NotResizable(Exception):
    """The mask program cannot be resized soundly; the message says which node and why."""


def _replace_length(tree, length: int, value: int, only: int | None, seen: list[int]):
    """``tree`` (an fx argument structure) with the integers equal to ``length`` replaced by ``value``: all of them,
    or the ``only``-th in traversal order; ``seen[0]`` counts them."""
    if isinstance(tree, bool) or isinstance(tree, fx.Node):
        return tree
    if isinstance(tree, int):
        if tree != length:
            return tree
        seen[0] += 1
        return value if only is None or only == seen[0] - 1 else tree
    if isinstance(tree, slice):
        return slice(*(_replace_length(x, length, value, only, seen) for x in (tree.start, tree.stop, tree.step)))
    if isinstance(tree, torch.Size):
        return torch.Size(_replace_length(list(tree), length, value, only, seen))
    if isinstance(tree, tuple):
        return tuple(_replace_length(x, length, value, only, seen) for x in tree)
    if isinstance(tree, list):
        return [_replace_length(x, length, value, only, seen) for x in tree]
    if isinstance(tree, dict):
        return {k: _replace_length(x, length, value, only, seen) for k, x in tree.items()}
    return tree


def _ints_of(tree, found: set[int]) -> None:
    if isinstance(tree, bool) or isinstance(tree, fx.Node):
        return
    if isinstance(tree, int):
        found.add(tree)
    elif isinstance(tree, slice):
        _ints_of((tree.start, tree.stop, tree.step), found)
    elif isinstance(tree, (tuple, list)):
        for x in tree:
            _ints_of(x, found)
    elif isinstance(tree, dict):
        _ints_of(list(tree.values()), found)


def _call(node: fx.Node, args, kwargs):
    if node.op == "call_method":
        self_arg, *rest = args
        return getattr(self_arg, node.target)(*rest, **kwargs)
    return node.target(*args, **kwargs)


def _output_shape(value) -> object:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else value


def _on_meta(tree):
    """An fx argument structure with its nodes' traced tensors as meta tensors and every device the meta device:
    an op's shapes without its data, and without the fake mode's logging of an op that refuses its arguments."""
    meta = torch.device("meta")

    def convert(x):
        value = fake_value(x) if isinstance(x, fx.Node) else x
        if isinstance(value, torch.Tensor):
            return torch.empty(tuple(value.shape), dtype=value.dtype, device=meta)
        if isinstance(value, torch.device):
            return meta
        if isinstance(value, (tuple, list)):
            return type(value)(convert(v) for v in value) if type(value) in (tuple, list) else value
        if isinstance(value, dict):
            return {k: convert(v) for k, v in value.items()}
        return value

    return convert(tree)


def _is_size(node: fx.Node, occurrence: int, length: int) -> bool:
    """Whether the ``occurrence``-th integer equal to ``length`` among ``node``'s arguments sets a size: the op run
    on meta tensors of its traced shapes with it changed gives another shape, or refuses it where the traced
    arguments run (`NotResizable` when those do not run here either)."""

    def run(args, kwargs):
        args, kwargs = _on_meta((args, kwargs))
        if node.op == "call_function" and node.target in _FACTORIES:
            kwargs["device"] = torch.device("meta")
        return _output_shape(_call(node, args, kwargs))

    try:
        before = run(node.args, dict(node.kwargs))
    except Exception as err:  # noqa: BLE001 - cannot be tried here: not resized
        raise NotResizable(f"{_op(node)} {node.name} does not run on meta tensors of its traced shapes ({err})") from err
    try:
        after = run(*_replace_length((node.args, dict(node.kwargs)), length, length - 1, occurrence, [0]))
    except Exception:  # noqa: BLE001 - the op refuses the other size: the integer is a size
        return True
    return after != before


_FACTORIES = {torch.arange, torch.ones, torch.zeros, torch.full, torch.empty, torch.linspace, torch.tensor,
              torch.eye, torch.tril_indices, torch.triu_indices, torch.randn, torch.rand}
"""Ops that allocate a tensor of their own: tried on the meta device (a size of L x L would allocate it)."""


def probe_length(length: int, wanted: int, module: fx.GraphModule) -> int:
    """A block length of at least ``wanted`` tokens (at most ``length``) that equals no integer or dimension of the
    program (Note [Mask programs probed on shorter blocks])."""
    taken: set[int] = set()
    for node in module.graph.nodes:
        _ints_of((node.args, dict(node.kwargs)), taken)
        value = fake_value(node)
        if isinstance(value, torch.Tensor):
            taken.update(int(d) for d in value.shape)
    block = wanted
    while block in taken or block - 1 in taken:
        block += 1
    return min(block, length)


def resized_program(module: fx.GraphModule, length: int, block: int, inputs: list[torch.Tensor]
                    ) -> tuple[fx.GraphModule, dict[fx.Node, fx.Node]]:
    """The mask program traced at ``length`` tokens, resized to ``block`` tokens, and the map from its nodes to the
    resized ones; raises `NotResizable` (Note [Mask programs probed on shorter blocks]).  ``inputs``: the program's
    inputs at ``block`` tokens, on which the resized shapes are checked."""
    graph = fx.Graph()
    mapping: dict[fx.Node, fx.Node] = {}
    for node in module.graph.nodes:
        copied = graph.node_copy(node, lambda n: mapping[n])
        mapping[node] = copied
        if node.op not in ("call_function", "call_method"):
            continue
        count = [0]
        _replace_length((node.args, dict(node.kwargs)), length, block, None, count)
        for occurrence in range(count[0]):
            if not _is_size(node, occurrence, length):
                raise NotResizable(f"{_op(node)} {node.name} uses the integer {length} (the shard's length) as a "
                                   "value, which could be a constant of the model as well")
        copied.args, copied.kwargs = _replace_length((copied.args, dict(copied.kwargs)), length, block, None, [0])
    resized = fx.GraphModule(module, graph)
    shapes: dict[fx.Node, object] = {}

    class _Shapes(fx.Interpreter):
        def run_node(self, n: fx.Node):
            out = super().run_node(n)
            shapes[n] = _output_shape(out)
            return out

    try:
        with torch.no_grad():
            _Shapes(resized).run(*inputs)
    except Exception as err:  # noqa: BLE001 - a program that does not run resized is probed as traced
        raise NotResizable(f"it does not run on {block} tokens ({err})") from err
    for node, copied in mapping.items():
        traced = fake_value(node)
        if node.op == "output" or not isinstance(traced, torch.Tensor):
            continue
        expected = tuple(block if d == length else int(d) for d in traced.shape)
        if shapes.get(copied) != expected:
            raise NotResizable(f"{_op(node)} {node.name} has shape {shapes.get(copied)} on {block} tokens where "
                               f"its traced shape {tuple(traced.shape)} would give {expected}")
    return resized, mapping
