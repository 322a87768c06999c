"""Comparing an autocast (bf16 or fp16) training step on several ranks with the same step on one device, element by
element, to what the precision's rounding of differently split sums allows (Note [The bf16 comparison])."""

from __future__ import annotations

import torch

from tests.autosp.cases import FP32_TOL

# Note [The bf16 comparison]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# An AutoSP step under autocast (bf16, or fp16) against the same single-device step under the same autocast: same
# model, seed and samples, the gradients read before any optimizer step.  Autocast rounds every matmul's output to
# the low precision (unit roundoff u: 2^-8 for bf16's 8 significant bits, 2^-11 for fp16's 11), so the two runs
# agree exactly only where they compute the same sums in the same shapes:
# - the forward: each token's activations are the same sums in both runs (row-wise matmuls, attention over the
#   whole sequence per head after the all-to-all), so the logits are bitwise equal and the loss differs by the
#   fp32 round-off of its sum over the shards, held to four units of fp32's 2^-24 (measured: at most 1.5 units,
#   HF Llama, Qwen2 and Mistral on 2 and 4 ranks); the loss's distance from the fp32 run's loss is checked to be
#   over four times that, which makes the loss a witness of the low precision too;
# - an nn.Linear weight's gradient is a sum over tokens of dy x^T, rounded once on one device and once per rank's
#   shard before the fp32 sum over ranks under AutoSP: |difference| <= u |g| + u (|P_0| + |P_1|) <= 2 u S
#   elementwise, with S = sum over tokens of |dy| |x|^T (the terms' absolute values, recorded by hooks in the
#   reference run, `linear_term_sums`) and P_r rank r's partial sum; allowed: 3 u S (one u more for the GEMMs' fp32
#   accumulation and a rounding of an output gradient that the fp32 loss scaling moves across a rounding
#   boundary).  S bounds each element by the magnitude of its own terms, so a gradient that cancels to near zero is
#   held to the error its sum can actually have, not to a fraction of the tensor's largest element.  A Linear's
#   bias gradient is the sum over tokens of dy, rounded the same way: S = sum over tokens of |dy|;
# - the other parameters (norm weights, the embedding) take fp32 gradients from per-token values equal in both
#   runs, differing by the order of the fp32 sum over tokens: the fp32 tolerance.
# Two conditions keep the per-token equality: key/value heads at least as many as the ranks (with fewer, Ulysses
# replicates a key/value head on several ranks and sums its gradient over them in the low precision, where one
# device sums it inside attention's backward in fp32: the per-token gradient reaching the embedding and the norms
# then differs by a rounding; that layout is exact in fp32, tests/autosp/test_equivalence.py), and no attention
# padding in the samples: with a padding mask AutoSP's attention takes a
# different path than eager SDPA's, whose low-precision output differs by up to one unit in the last place, and the
# per-token equality the bound rests on no longer holds (fp32 runs cover padding).

UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
LINEAR_GRAD_FACTOR = 3  # x u x S, Note [The bf16 comparison]
LOSS_RTOL = 4 * 2.0 ** -24  # fp32 round-off of the loss's sum over shards, Note [The bf16 comparison]


def linear_term_sums(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """For each nn.Linear weight of ``model``, S = sum over tokens of |dy| |x|^T (x as the ``dtype`` matmul reads
    it), and for its bias the sum over tokens of |dy|, filled by hooks during the training step that follows
    (Note [The bf16 comparison])."""
    sums: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            def forward_hook(mod, args, out):
                mod.seen_input = args[0].detach().to(dtype).float().abs().flatten(0, -2)

            def backward_hook(mod, grad_input, grad_output, prefix=f"{name}."):
                dy = grad_output[0].detach().float().abs().flatten(0, -2)
                sums[prefix + "weight"] = sums.get(prefix + "weight", 0) + dy.T @ mod.seen_input
                if mod.bias is not None:
                    sums[prefix + "bias"] = sums.get(prefix + "bias", 0) + dy.sum(0)

            module.register_forward_hook(forward_hook)
            module.register_full_backward_hook(backward_hook)
    return sums


def computed_in(values: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether every value (e.g. a compiled model's logits, upcast) is a ``dtype`` value and not all zero: a witness
    that the program ran in that precision, as an fp32 matmul's output essentially never is one."""
    values = values.detach().float()
    return bool((values == values.to(dtype).float()).all() and values.abs().max() > 0)


def check_loss(loss: torch.Tensor | float, expected: torch.Tensor | float, fp32_loss: float, where: str) -> None:
    """The low-precision loss equals the single-device one to fp32 round-off, and that tolerance tells it from the
    fp32 loss (Note [The bf16 comparison])."""
    expected, loss = torch.as_tensor(expected, dtype=torch.float32), torch.as_tensor(loss, dtype=torch.float32)
    assert abs(float(expected) - fp32_loss) > 4 * LOSS_RTOL * abs(fp32_loss), \
        f"{where}: the low-precision loss {float(expected)!r} is too near the fp32 one {fp32_loss!r} to tell them apart"
    torch.testing.assert_close(loss, expected, rtol=LOSS_RTOL, atol=0,
                               msg=lambda m: f"{where} loss (fp32 loss {fp32_loss}): {m}")


def check_gradients(grads: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                    sums: dict[str, torch.Tensor], dtype: torch.dtype, where: str) -> None:
    """Every gradient of ``grads`` against the single-device ``expected``: nn.Linear weights and biases (those in
    ``sums``) within 3 u S elementwise, the others within the fp32 tolerance (Note [The bf16 comparison])."""
    assert grads.keys() == expected.keys(), (where, sorted(set(grads) ^ set(expected)))
    assert sums, f"{where}: no nn.Linear weight recorded, nothing would be held to the low-precision bound"
    for name, grad in grads.items():
        want = expected[name]
        assert want.abs().max() > 0, f"{where} {name}: no gradient, the comparison would be vacuous"
        if name in sums:
            allowed = LINEAR_GRAD_FACTOR * UNIT_ROUNDOFF[dtype] * sums[name]
            excess = (grad.float() - want.float()).abs() - allowed
            assert (excess <= 0).all(), (
                f"{where} {name}: {int((excess > 0).sum())} elements differ from the single-device run's by more "
                f"than {LINEAR_GRAD_FACTOR} u S (largest excess {excess.max():.3g})")
        else:
            torch.testing.assert_close(grad, want, **FP32_TOL, msg=lambda m, w=f"{where} {name}": f"{w}: {m}")
