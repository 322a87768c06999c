"""The fuzzer's oracle: each program exact on every rank, or refused on every rank.

`run_programs` runs many programs in one launch of gloo ranks (process start-up
and imports paid once).  On every rank, for each program: a fresh Dynamo state,
one single-device reference model and one copy compiled by AutoSP
(``compiler="aot_eager"``, default options), then for each of the program's
lengths in order, one training step on both (the same compiled instance serves
every length).  Each call ends as

- ``exact``: loss and every gradient (after ``sync_gradients``) equal the
  reference's, fp32 rtol 1e-4 / atol 1e-6;
- ``refused``: an `autosp.AutoSPError`;
- ``wrong``: accepted, but the loss or a gradient differs (a finding);
- ``crash``: any other exception (a finding);
- ``invalid``: the reference itself failed or is not finite (a generator bug, not a finding).

`classify` then compares the ranks: a call whose outcome differs between ranks
is a finding (``disagree``).  A launch that dies or hangs is retried one
program per launch, so the culprit is named (``launch``).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import re
import time
import traceback
from dataclasses import dataclass, field

from experiments.fuzz.programs import OPS, POSITIONS, Program, build_model, make_batch
from experiments.launch import RankFailure, run_on_ranks

log = logging.getLogger(__name__)

TOLERANCE = {"rtol": 1e-4, "atol": 1e-6}
FINDING_STATUSES = ("wrong", "crash", "disagree", "launch")


def _close(a, b) -> tuple[bool, float]:
    import torch

    diff = float((a - b).abs().max()) if a.numel() else 0.0
    ok = bool(torch.allclose(a, b, **TOLERANCE)) and bool(torch.isfinite(a).all())
    return ok, diff


def _where(tb: str) -> str:
    """' (raised at autosp/...:LINE in FN)' for the innermost frame of the autosp package in a traceback."""
    frames = re.findall(r'File "[^"]*?/(autosp/[^"]+)", line (\d+), in (\w+)', tb)
    return f" (raised at {frames[-1][0]}:{frames[-1][1]} in {frames[-1][2]})" if frames else ""


def _call(program: Program, reference, candidate, compiled, sp_size: int, seq_len: int, call: int) -> dict:
    import torch

    import autosp

    ids, labels, mask = make_batch(program, seq_len, call)
    extra = {"attention_mask": mask} if mask is not None else {}
    reference.zero_grad(set_to_none=True)
    candidate.zero_grad(set_to_none=True)
    # The single-device call a user makes: prepare_inputs' default positions, 0..S-1, where the model takes them.
    ref_extra = dict(extra, position_ids=torch.arange(seq_len)[None].expand_as(ids)) if program.takes_positions else extra
    try:
        ref = reference(input_ids=ids, labels=labels, **ref_extra).loss
        ref.backward()
    except Exception as err:  # noqa: BLE001 - a generator bug, reported as such
        return {"status": "invalid", "length": seq_len, "message": f"reference failed: {type(err).__name__}: {err}"}
    if not torch.isfinite(ref):
        return {"status": "invalid", "length": seq_len, "message": "reference loss is not finite"}
    try:
        out = compiled(**autosp.prepare_inputs(ids, labels=labels, **extra)).loss
        out.backward()
        autosp.sync_gradients(compiled)
    except autosp.AutoSPError as err:
        return {"status": "refused", "length": seq_len, "message": str(err)}
    except Exception as err:  # noqa: BLE001 - every other failure is a finding
        inner = getattr(err, "inner_exception", None) or err
        return {"status": "crash", "length": seq_len,
                "message": f"{type(inner).__name__}: {str(inner).splitlines()[0] if str(inner) else ''}"
                           f"{_where(traceback.format_exc())}"}
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    grads = {n: p.grad for n, p in candidate.named_parameters() if p.grad is not None}
    mismatches = []
    ok, diff = _close(out.detach(), ref.detach())
    if not ok:
        mismatches.append(("loss", diff))
    for name in sorted(set(ref_grads) | set(grads)):
        if name not in grads or name not in ref_grads:
            mismatches.append((f"grad {name} {'missing' if name not in grads else 'unexpected'}", math.inf))
            continue
        ok, diff = _close(grads[name], ref_grads[name])
        if not ok:
            mismatches.append((f"grad {name}", diff))
    result = {"status": "exact" if not mismatches else "wrong", "length": seq_len, "loss": float(out.detach()),
              "ref_loss": float(ref.detach())}
    if mismatches:
        result["message"] = (f"loss {result['loss']:.6f} vs single-device {result['ref_loss']:.6f}; mismatched: "
                             + ", ".join(f"{n} (max |diff| {d:.3g})" for n, d in mismatches[:6]))
    return result


def run_program(program: Program, sp_size: int) -> list[dict]:
    """All of one program's calls on this rank (the process group is initialised)."""
    import torch

    import autosp

    torch._dynamo.reset()
    try:
        reference = build_model(program)
        candidate = copy.deepcopy(reference)
        compiled = autosp.compile(candidate, sp_size=sp_size, compiler="aot_eager")
    except Exception as err:  # noqa: BLE001
        return [{"status": "crash", "length": None, "message": f"set-up: {type(err).__name__}: {err}"}]
    calls = []
    for i, n in enumerate(program.lengths):
        start = time.perf_counter()
        calls.append(_call(program, reference, candidate, compiled, sp_size, n, i))
        calls[-1]["seconds"] = time.perf_counter() - start
    return calls


def _programs_on_rank(rank, world, programs):
    """Rank entry point: every program in turn; stops early (a partial list) when the ranks' outcomes diverge,
    since their collectives may then be out of step."""
    import torch.distributed as dist

    outcomes = []
    for program in programs:
        calls = run_program(program, world)
        outcomes.append(calls)
        statuses = [c["status"] for c in calls]
        everyone = [None] * world
        dist.all_gather_object(everyone, statuses)
        if any(s != statuses for s in everyone):
            break
    return outcomes


@dataclass
class ProgramResult:
    program: Program
    status: str
    """exact | refused | mixed (some lengths exact, some refused) | invalid | a finding: wrong, crash, disagree,
    launch."""
    calls: list = field(default_factory=list)
    """Per rank, per call: the dicts `_call` returns."""
    message: str = ""

    @property
    def is_finding(self) -> bool:
        return self.status in FINDING_STATUSES

    def signature(self) -> str:
        """What kind of finding this is: for a wrong result, the ops that are not token-local (the suspects); else
        the message without the numbers that differ between instances."""
        if self.status == "wrong":
            suspects = sorted({o for o in self.program.ops if OPS[o].kind != "local"}
                              | ({f"positions={self.program.positions}"} if self.program.positions != "none" else set()))
            return f"wrong: {', '.join(suspects) or 'token-local ops only'}"
        text = re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", self.message.split("\n")[0].split(";")[0])
        return f"{self.status}: {text[:160]}"


def classify(program: Program, per_rank: list[list[dict]]) -> ProgramResult:
    calls_by_rank = per_rank
    n_calls = {len(c) for c in calls_by_rank}
    if len(n_calls) != 1:
        return ProgramResult(program, "disagree", calls_by_rank, "ranks ran different numbers of calls")
    statuses = []
    for i in range(n_calls.pop()):
        kinds = [c[i]["status"] for c in calls_by_rank]
        if len(set(kinds)) > 1:
            detail = "; ".join(f"rank {r}: {c[i]['status']} {c[i].get('message', '')[:300]}"
                               for r, c in enumerate(calls_by_rank))
            return ProgramResult(program, "disagree", calls_by_rank,
                                 f"ranks disagree at length {calls_by_rank[0][i]['length']}: {detail}")
        statuses.append(kinds[0])
    for bad in ("invalid", "crash", "wrong"):
        if bad in statuses:
            i = statuses.index(bad)
            rank = next((r for r, c in enumerate(calls_by_rank) if c[i]["status"] == bad), 0)
            call = calls_by_rank[rank][i]
            return ProgramResult(program, bad, calls_by_rank,
                                 f"{call.get('message', '')} (length {call['length']}, call {i}, rank {rank})")
    if set(statuses) == {"exact"}:
        return ProgramResult(program, "exact", calls_by_rank)
    if set(statuses) == {"refused"}:
        return ProgramResult(program, "refused", calls_by_rank, calls_by_rank[0][0]["message"])
    return ProgramResult(program, "mixed", calls_by_rank,
                         " / ".join(f"{c['length']}: {c['status']}" for c in calls_by_rank[0]))


def run_programs(programs: list[Program], sp_size: int, *, batch_size: int = 50, timeout_per_program_s: float = 90.0,
                 collective_timeout_s: float = 120.0) -> list[ProgramResult]:
    """Run ``programs`` on ``sp_size`` gloo ranks, ``batch_size`` per launch; one result per program, in order."""
    results: list[ProgramResult] = []
    pending = list(programs)
    while pending:
        batch = pending[:batch_size]
        try:
            per_rank = run_on_ranks(_programs_on_rank, sp_size, batch,
                                    timeout_s=30 + timeout_per_program_s * len(batch),
                                    collective_timeout_s=collective_timeout_s)
        except RankFailure as err:
            if len(batch) == 1:
                results.append(ProgramResult(batch[0], "launch", [], str(err)[-3000:]))
                pending = pending[1:]
                continue
            log.warning("a launch of %d programs failed; retrying them one per launch", len(batch))
            for program in batch:
                results.extend(run_programs([program], sp_size, batch_size=1,
                                            timeout_per_program_s=timeout_per_program_s,
                                            collective_timeout_s=collective_timeout_s))
            pending = pending[len(batch):]
            continue
        done = min(len(r) for r in per_rank)
        for i in range(done):
            results.append(classify(batch[i], [r[i] for r in per_rank]))
        if not done:
            results.append(ProgramResult(batch[0], "launch", [], "no program finished in the launch"))
            done = 1
        pending = pending[done:]
    return results


def summarize(results: list[ProgramResult]) -> dict:
    counts: dict[str, int] = {}
    for r in results:
        counts[r.status] = counts.get(r.status, 0) + 1
    calls = sum(len(r.calls[0]) if r.calls else 0 for r in results)
    return {"programs": len(results), "calls": calls, "by_status": counts,
            "findings": sum(r.is_finding for r in results)}


def _simpler(program: Program) -> list[Program]:
    """Programs one step simpler than ``program``: an op, a length, the positions, the mask removed."""
    out = [dataclasses.replace(program, ops=program.ops[:i] + program.ops[i + 1:]) for i in range(len(program.ops))]
    if len(program.lengths) > 1:
        out += [dataclasses.replace(program, lengths=program.lengths[:i] + program.lengths[i + 1:])
                for i in range(len(program.lengths))]
    if program.positions != "none":
        out.append(dataclasses.replace(program, positions="none"))
    if program.loss != "pad_shift":
        out.append(dataclasses.replace(program, loss="pad_shift"))
    needs = set().union(*(OPS[o].needs for o in program.ops)) if program.ops else set()
    needs |= POSITIONS[program.positions][1]
    if program.mask and "mask" not in needs:
        out.append(dataclasses.replace(program, mask=False))
    if program.takes_positions and "positions" not in needs:
        out.append(dataclasses.replace(program, takes_positions=False))
    return out


def shrink(finding: ProgramResult, sp_size: int, *, max_rounds: int = 8) -> ProgramResult:
    """A smallest program (greedily, one launch per round) that still gives ``finding``'s kind of finding."""
    best = finding
    for _ in range(max_rounds):
        candidates = _simpler(best.program)
        if not candidates:
            break
        results = run_programs(candidates, sp_size, batch_size=len(candidates))
        same = [r for r in results if r.status == best.status
                and (r.status == "wrong" or r.signature() == best.signature())]
        if not same:
            break
        best = same[0]
    return best
