"""The torch DeviceMesh built from a plan, and KV heads shared over tensor parallelism.

The mesh checks start real ranks with torchrun; the consistency check between the plan's group
rules and its mesh is also exercised directly on tampered plans (no processes needed).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.test_runtime_support import plan_for, spec_text

torch = pytest.importorskip("torch")

from mixle_compile.runtime.mesh import device_mesh_layout, device_mesh_problems, rule_members  # noqa: E402

WORKER = """
import json, sys
import torch
import torch.distributed as dist
from mixle_compile.runtime import load_plan_or_spec
from mixle_compile.runtime.parameters import initial_value
from mixle_compile.runtime.session import open_session

session = open_session(load_plan_or_spec(sys.argv[1]))
mesh, dm = session.mesh, session.mesh.device_mesh
out = {
    "rank": mesh.rank,
    "names": list(dm.mesh_dim_names),
    "shape": list(dm.shape),
    "mesh": dm.mesh.tolist(),
    "dims": {name: sorted(dist.get_process_group_ranks(dm.get_group(name))) for name in dm.mesh_dim_names},
    "coordinate": dm.get_coordinate(),
}
# The mesh's groups carry collectives.
t = torch.tensor([float(mesh.rank)])
dist.all_reduce(t, group=dm.get_group("tp"))
out["tp_sum"] = float(t)
# Whole tensors reassembled from shards and tensor-parallel slices (KV heads shared over tp).
weights = session.parameters_global()
out["global_unequal"] = [p.name for p in session.instructions.params if not torch.equal(weights[p.name], \
initial_value(session.instructions.param(p.canonical), session.instructions.seed))]
out["k_slice"] = [list(s) for s in session.store.of_use["layers.0.attn.k_proj.weight"].tp_slices]
session.close()
with open(f"{sys.argv[2]}.{out['rank']}.json", "w") as f:
    json.dump(out, f)
"""


def torchrun(args: list[str], cwd, nproc: int) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    env = {
        k: v
        for k, v in __import__("os").environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=240, env=env)


def test_the_device_mesh_has_the_plans_groups_on_four_ranks(tmp_path):
    # dp_shard 2 x tp 2, one KV head shared by both tp ranks of each data shard.
    text = spec_text(ds=2, tp=2, kv_heads=1)
    (tmp_path / "spec.yaml").write_text(text)
    (tmp_path / "worker.py").write_text(WORKER)
    done = torchrun(["worker.py", "spec.yaml", "out"], tmp_path, nproc=4)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = plan_for(ds=2, tp=2, kv_heads=1)
    rules = {r.name: r for r in doc.groups.rules}
    plan_groups = {
        name: [rule_members(rules[name], i) for i in range(rules[name].num_groups)] for name in ("dp_shard", "tp")
    }
    assert plan_groups == {"dp_shard": [(0, 2), (1, 3)], "tp": [(0, 1), (2, 3)]}  # tp innermost
    for rank in range(4):
        out = json.loads((tmp_path / f"out.{rank}.json").read_text())
        assert out["names"] == ["dp_shard", "tp"] and out["shape"] == [2, 2]
        assert out["mesh"] == [[0, 1], [2, 3]]
        for name in ("dp_shard", "tp"):
            (mine,) = [g for g in plan_groups[name] if rank in g]
            assert tuple(out["dims"][name]) == mine
        assert out["coordinate"] == [rank // 2, rank % 2]
        (tp_group,) = [g for g in plan_groups["tp"] if rank in g]
        assert out["tp_sum"] == sum(tp_group)
        assert out["global_unequal"] == []
        assert out["k_slice"] == [[0, 0, 8]]  # the one KV head's 8 rows, on both tp ranks


def test_the_mesh_tensor_follows_the_plans_rank_order():
    doc = plan_for(ds=2, tp=2)
    names, table = device_mesh_layout(doc.groups)
    assert names == ("dp_shard", "tp") and table.tolist() == [[0, 1], [2, 3]]
    reordered = doc.groups.model_copy(
        update={
            "order": "dp-tp-cp-ep-pp",
            "dense": doc.groups.dense.model_copy(
                update={
                    "dims": [
                        d.model_copy(
                            update={"stride": {"dp_shard": 1, "dp_replicate": 2, "tp": 2, "cp": 4, "pp": 4}[d.axis]}
                        )
                        for d in doc.groups.dense.dims
                    ]
                }
            ),
        }
    )
    names, table = device_mesh_layout(reordered)
    assert names == ("tp", "dp_shard") and table.tolist() == [[0, 1], [2, 3]]


def test_group_rules_that_disagree_with_the_mesh_are_refused():
    doc = plan_for(ds=2, tp=2)
    names, table = device_mesh_layout(doc.groups)
    members = {
        r.name: next(g for g in (rule_members(r, i) for i in range(r.num_groups)) if 0 in g)
        for r in doc.groups.rules
        if r.grid == "dense" and r.name != "embedding"
    }
    assert device_mesh_problems(doc.groups, names, table, 0, members) == []
    # A tampered plan whose tp rule generates the data-parallel groups.
    tp = next(r for r in doc.groups.rules if r.name == "tp")
    shard = next(r for r in doc.groups.rules if r.name == "dp_shard")
    rules = [
        r.model_copy(update={"dims": shard.dims, "base_dims": shard.base_dims}) if r is tp else r
        for r in doc.groups.rules
    ]
    tampered = doc.groups.model_copy(update={"rules": rules})
    members["tp"] = rule_members(rules[[r.name for r in rules].index("tp")], 0)
    problems = device_mesh_problems(tampered, names, table, 0, members)
    assert problems == ["rule 'tp' puts rank 0 in the group [0, 2], but the device mesh (dp_shard, tp) gives [0, 1]"]


def test_a_grid_that_does_not_number_every_rank_once_is_refused():
    from mixle_compile.runtime.errors import RuntimeRefusal

    doc = plan_for(ds=2, tp=2)
    dims = [d.model_copy(update={"stride": 1}) if d.axis == "dp_shard" else d for d in doc.groups.dense.dims]
    broken = doc.groups.model_copy(update={"dense": doc.groups.dense.model_copy(update={"dims": dims})})
    with pytest.raises(RuntimeRefusal, match="the same coordinates"):
        device_mesh_layout(broken)
