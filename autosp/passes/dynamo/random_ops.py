"""Op family: random ops.  See Note [Op rule registry] in autosp.passes.dynamo.registry.

Every rank of an SP group draws the same random stream, so random values drawn per
token would repeat on every sequence shard: refused on token-sharded values.
"""

from __future__ import annotations

from torch import fx

from autosp.passes.dynamo.placements import REPLICATE, Shard
from autosp.passes.dynamo.pointwise import elementwise
from autosp.passes.dynamo.registry import arguments, rule, sharded_inputs


@rule("refused on tokens: random", "rand_like", "randn_like", "randint_like", "bernoulli", "multinomial", "normal",
      "poisson", "bernoulli_", "uniform_", "normal_")
def random_like(an, gm, node: fx.Node):
    if any(isinstance(p, Shard) and not p.tentative for _, p in sharded_inputs(an, node)):
        raise an.refuse(node, "draws random numbers for token-sharded values: every rank of the SP group draws the "
                        "same random stream, so the draws would repeat every sequence shard",
                        "draw them outside the compiled model, or train without sequence parallelism")
    p = an.of(node.args[0]) if node.args else REPLICATE
    return p if isinstance(p, Shard) else REPLICATE


@rule("token-local: elementwise", "dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d",
      "dropout3d")
def dropout(an, gm, node: fx.Node):
    bound = arguments(node)
    p, training = bound.get("p", 0.5), bound.get("training", bound.get("train", True))
    if p and training and any(isinstance(q, Shard) and not q.tentative for _, q in sharded_inputs(an, node)):
        raise an.refuse(node, f"applies dropout (p={p}) to token-sharded activations: every rank of the SP group "
                        "draws the same random stream, so the masks would repeat every sequence shard",
                        "set the model's dropout probabilities to 0 (long-context pretraining recipes use none) "
                        "or call model.eval()")
    return elementwise(an, node)
