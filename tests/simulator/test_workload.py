"""The workload schema: JSON round trips, version checks and validation errors that say what to change."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

from simulator import SCHEMA_VERSION, Collective, Op, ProgramBuilder, StaticMemory, Workload, WorkloadError
from simulator.synthetic import LlamaShape, llama_ulysses_workload
from simulator.validate import validate_workload
from tests.simulator.toys import overlap_program, symmetric


def _rich_workload() -> Workload:
    programs = {}
    for rank in (0, 1):
        b = ProgramBuilder()
        t = b.tensor(1024)
        a = b.compute("mm", op_class="matmul", flops=10**6, bytes_read=4096, bytes_written=1024, allocates=[t])
        s = b.start("a2a", kind="all_to_all", group="sp", message_bytes=512, deps=[a], key="k0")
        b.wait(s, frees=[t])
        b.compute("sdpa", op_class="attention", flops=4 * 16 * 10**4, attention_scores=10**4, deps=[a])
        b.collective("p2p", kind="send" if rank == 0 else "recv", group="sp", message_bytes=64, peer=1 - rank,
                     key="k1", phase="backward")
        programs[rank] = b.build(StaticMemory(parameter_bytes=10, gradient_bytes=20, optimizer_bytes=30,
                                              other_bytes=40))
    return Workload(name="rich", world_size=2, groups={"sp": [[0, 1]]}, ranks=programs,
                    metadata={"seq_len": 128, "note": "x"})


def test_workload_dict_round_trip_is_lossless():
    workload = _rich_workload()
    again = Workload.from_dict(json.loads(json.dumps(workload.to_dict())))
    assert again == workload
    assert again.ranks[0].ops[3].attention_scores == 10**4
    assert again.ranks[1].ops[4].collective == Collective(kind="recv", group="sp", message_bytes=64, key="k1", peer=0)


def test_workload_json_file_round_trip_is_lossless(tmp_path):
    workload = llama_ulysses_workload(seq_len=1024, sp_degree=2,
                                      shape=LlamaShape(layers=1, hidden=64, heads=4, kv_heads=2, ffn_hidden=128,
                                                       vocab=100))
    path = tmp_path / "w.json"
    workload.to_json(path)
    assert Workload.from_json(path) == workload


def test_workload_flat_group_list_is_read_as_one_instance():
    workload = Workload(name="g", world_size=2, groups={"sp": [0, 1]}, ranks={0: overlap_program().build()},
                        symmetric=True)
    assert workload.groups == {"sp": ((0, 1),)}
    assert workload.group_instance("sp", 1) == (0, 1)


def test_workload_wrong_version_says_to_re_export():
    doc = _rich_workload().to_dict()
    doc["version"] = SCHEMA_VERSION + 1
    with pytest.raises(WorkloadError, match="re-export"):
        Workload.from_dict(doc)


def test_workload_error_is_a_value_error():
    assert issubclass(WorkloadError, ValueError)


def test_workload_invalid_json_file_is_a_workload_error(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(WorkloadError, match="not valid JSON"):
        Workload.from_json(path)


def _mutate(path, value):
    doc = _rich_workload().to_dict()
    target = doc
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return doc


MALFORMED = [
    ((["name"], KeyError), "missing required field"),
    ((["ranks"], [1, 2]), "ranks must be an object"),
    ((["ranks", "0", "ops", 0, "flops"], "many"), "flops must be an integer"),
    ((["ranks", "0", "ops", 0, "speed"], 3), "unknown field"),
    ((["ranks", "0", "ops", 0, "kind"], "kernel"), "kind 'kernel' is not one of"),
    ((["ranks", "0", "ops", 0, "op_class"], "gemm"), "op_class 'gemm'"),
    ((["ranks", "0", "ops", 0, "phase"], "fwd"), "phase 'fwd'"),
    ((["ranks", "0", "ops", 0, "deps"], [3]), "deps point backwards"),
    ((["ranks", "0", "ops", 1, "collective", "group"], "tp"), "group 'tp' is not in workload.groups"),
    ((["ranks", "0", "ops", 1, "collective", "kind"], "gossip"), "collective kind 'gossip'"),
    ((["ranks", "0", "ops", 2, "collective", "key"], "zz"), "no earlier collective_start"),
    ((["ranks", "0", "ops", 0, "allocates"], [7]), "missing from the program's tensors"),
    ((["ranks", "0", "static_memory", "weights"], 1), "unknown field"),
    ((["ranks", "1"], KeyError), "one program for each of ranks"),
    ((["world_size"], 0), "positive integer"),
    ((["groups", "sp"], [[0, 1], [1]]), "lists rank 1 twice"),
    ((["groups", "sp"], [[0, 5]]), "outside 0..1"),
    ((["ranks", "1", "ops", 4, "collective", "kind"], "send"), "no matching recv"),
    ((["ranks", "0", "ops", 0, "attention_scores"], 5), "only attention ops have scores"),
    ((["ranks", "0", "ops", 3, "attention_scores"], -1), "must be non-negative"),
]


@pytest.mark.parametrize(("mutation", "message"), MALFORMED, ids=[m for _, m in MALFORMED])
def test_workload_malformed_documents_raise_clear_errors(mutation, message):
    with pytest.raises(WorkloadError, match=message):
        Workload.from_dict(_mutate(*mutation))


def _program(*ops, tensors=None):
    from simulator import RankProgram

    return RankProgram(ops=tuple(ops), tensors=tensors or {})


def test_workload_validation_rejects_tensor_lifetime_mistakes():
    alloc = Op(id=0, name="a", kind="compute", allocates=(0,))
    cases = [
        (_program(alloc, Op(id=1, name="b", kind="compute", allocates=(0,)), tensors={0: 8}), "already allocated"),
        (_program(Op(id=0, name="a", kind="compute", frees=(0,)), tensors={0: 8}), "no earlier op"),
        (_program(alloc, Op(id=1, name="b", kind="compute", frees=(0,)), Op(id=2, name="c", kind="compute", frees=(0,)),
                  tensors={0: 8}), "freed twice"),
        (_program(alloc, Op(id=0, name="dup", kind="compute"), tensors={0: 8}), "duplicate op id"),
        (_program(Op(id=0, name="a", kind="compute", flops=-1)), "non-negative"),
    ]
    for program, message in cases:
        with pytest.raises(WorkloadError, match=message):
            validate_workload(Workload(name="t", world_size=1, groups={"sp": [0]}, ranks={0: program}, symmetric=True))


def test_workload_symmetric_workloads_reject_point_to_point():
    b = ProgramBuilder()
    b.collective("s", kind="send", group="sp", message_bytes=8, peer=1)
    with pytest.raises(WorkloadError, match="symmetric workload cannot contain send"):
        validate_workload(symmetric(b))


def test_workload_symmetric_groups_must_cover_every_rank():
    workload = symmetric(overlap_program(), world=3, groups={"sp": [[0, 1]]})
    with pytest.raises(WorkloadError, match=r"ranks \[2\] are in no instance"):
        validate_workload(workload)


def test_workload_collective_missing_on_a_member_rank_is_reported():
    programs = {0: overlap_program().build(), 1: ProgramBuilder().build()}
    workload = Workload(name="m", world_size=2, groups={"sp": [0, 1]}, ranks=programs)
    with pytest.raises(WorkloadError, match="member rank 1 never does"):
        validate_workload(workload)


def test_workload_wait_must_carry_the_start_collective():
    doc = _rich_workload().to_dict()
    doc["ranks"]["0"]["ops"][2]["collective"]["message_bytes"] = 1
    with pytest.raises(WorkloadError, match="must equal that of its start"):
        Workload.from_dict(doc)


def test_workload_from_dict_does_not_mutate_its_input():
    doc = _rich_workload().to_dict()
    before = copy.deepcopy(doc)
    Workload.from_dict(doc)
    assert doc == before


def test_workload_module_imports_only_the_standard_library():
    code = ("import sys; import simulator.workload, simulator.validate, simulator.builder; "
            "bad = sorted(m for m in ('simpy', 'numpy', 'networkx', 'matplotlib', 'torch') if m in sys.modules); "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
