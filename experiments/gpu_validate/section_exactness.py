"""Section (a), exactness: the compiled step's loss and every gradient against the same step of the uncompiled model
on one device over the whole sequence, within the case's tolerance (`compare_with_reference` on each rank,
`exactness` over the ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

from experiments.gpu_validate.case_set import Case, Judged


def compare_with_reference(loss, ref_loss, grads: dict, ref_grads: dict, tol: dict) -> dict:
    """Loss and every gradient against the single-device ones, as tests/autosp/test_equivalence.py compares them:
    the failures and the worst error as a fraction of its tolerance (<= 1 passes)."""
    import torch

    def scaled(ref):
        atol = tol["atol"] * (float(ref.detach().abs().max().float()) if tol.get("relative_to_scale") else 1.0)
        return tol["rtol"], atol

    failures, worst = [], ("", 0.0)
    pairs = [("loss", loss, ref_loss), *((n, grads.get(n), r) for n, r in ref_grads.items())]
    if grads.keys() != ref_grads.keys():
        failures.append(f"gradients of {sorted(set(grads) ^ set(ref_grads))} on one side only")
    for name, got, ref in pairs:
        if got is None:
            continue
        if name != "loss" and not bool(ref.abs().max() > 0):
            failures.append(f"{name}: the single-device gradient is zero (the comparison would be vacuous)")
            continue
        rtol, atol = scaled(ref)
        got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
        ratio = float(((got - ref).abs() / (atol + rtol * ref.abs())).max())
        if ratio > worst[1]:
            worst = (name, ratio)
        try:
            torch.testing.assert_close(got, ref, rtol=rtol, atol=atol)
        except AssertionError as err:
            failures.append(f"{name}: {str(err).splitlines()[0]} ({str(err).splitlines()[1].strip()})")
    return {"failures": failures, "worst": worst, "loss": float(loss), "ref_loss": float(ref_loss)}


@dataclass
class Exactness(Judged):
    """Section (a) for one case: the compiled step against single-device training, on every rank."""

    case: str
    world: int
    loss: float
    ref_loss: float
    worst: str
    """The gradient (or loss) nearest its tolerance, and how near (error / tolerance, <= 1 passes)."""
    problems: list[str]


def exactness(case: Case, per_rank: list[dict]) -> Exactness:
    problems = [f"rank {r['rank']}: {f}" for r in per_rank for f in r["exact"]["failures"]]
    worst = max((r["exact"]["worst"] for r in per_rank), key=lambda w: w[1])
    return Exactness(case=case.name, world=case.world, loss=per_rank[0]["exact"]["loss"],
                     ref_loss=per_rank[0]["exact"]["ref_loss"], worst=f"{worst[0]} at {worst[1]:.2g} of tolerance",
                     problems=problems)
