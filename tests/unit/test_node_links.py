"""Which collectives cross nodes (autoshard/planning/node_links.py), against groups worked out by
hand from the mesh's rank order (runtime/mesh.py: rank = pp x (data x tp) + data x tp + tp_rank,
data = dp x cp + cp_rank), and the two cost models pricing them so."""
import dataclasses

import pytest

from autoshard.planning.costmodel import estimate
from autoshard.planning.graph_time import _action_seconds
from autoshard.planning.hardware import get_hardware
from autoshard.planning.meta_step import ActionWork
from autoshard.planning.node_links import crosses_nodes
from autoshard.planning.op_cost import OpWork
from autoshard.runtime.mesh import ParallelDims

# (dims, ranks per node) -> the kinds whose groups hold ranks of two nodes
CASES = [
    # tp 8 fills a node; a cp pair is ranks r and r + 8: a group of 2 across nodes
    (ParallelDims(tp=8, cp=2), 8, {"cp", "dp"}),
    # 4 ranks a stage, two stages a node: the data groups stay in, the 8-stage pipeline leaves
    (ParallelDims(tp=2, dp=2, pp=8), 8, {"pp", "shared"}),
    (ParallelDims(tp=2, dp=2, pp=2), 8, set()),
    # an expert group is 2 data ranks of tp 4 (8 ranks: a node); the same experts sit 8 ranks apart
    (ParallelDims(tp=4, dp=4, ep=2), 8, {"ep_dp", "dp"}),
    # cp pairs (tp 2) on 4-rank nodes: ranks 0, 2 (+ tp) in node 0; the replicas' dp in node 1
    (ParallelDims(tp=2, cp=2, dp=2), 4, {"dp"}),
    # tp 4 x cp 2 fills a node per stage: the stage's neighbour is the next node
    (ParallelDims(tp=4, cp=2, pp=2), 8, {"pp", "shared"}),
]


@pytest.mark.parametrize("dims,per_node,crossing", CASES)
def test_the_groups_that_cross_nodes_are_the_meshs(dims, per_node, crossing):
    names = {"ep_dp": "expert_dp"}
    want = {names.get(k, k) for k in crossing}
    got = {k for k in ("tp", "cp", "dp", "ep", "expert_dp", "pp", "shared") if crosses_nodes(dims, k, per_node)}
    assert got == want


def test_graph_time_prices_a_collective_by_where_its_group_is_not_its_size():
    """A cp all-gather of 2 ranks at tp=8 crosses nodes (before: priced on NVLink as any group of
    at most 8 ranks); at tp=4 it stays in."""
    hw = get_hardware("a100-80gb")
    action = ActionWork("F", 0, 0, OpWork(), (("all_gather", 64 << 20, 2, "cp"),), 0)
    across = _action_seconds(action, hw, 1.0, ParallelDims(tp=8, cp=2))
    inside = _action_seconds(action, hw, 1.0, ParallelDims(tp=4, cp=2))
    assert across > 5 * inside
    sends = ActionWork("F", 0, 0, OpWork(), (), 64 << 20)         # a stage's send: across only where stages are
    assert _action_seconds(sends, hw, 1.0, ParallelDims(tp=4, pp=2)) < \
        _action_seconds(sends, hw, 1.0, ParallelDims(tp=8, pp=2)) / 5


def _breakdown(hw, **split):
    return estimate(hidden=1024, layers=8, heads=16, vocab=32000, seq=1024, global_batch=16, microbatch=1,
                    hardware=hw, recompute="none", **split).breakdown


def test_the_closed_form_model_prices_pipeline_and_tied_links_from_the_mesh():
    """tp 4 x cp 2 x pp 2 on 8-GPU nodes: each stage is a node, so the pipeline's sends cross
    (before: tp x pp x dp = 8 <= 8 was taken as one node, cp left out). tp 1 x pp 2 on one node: the
    tied embedding's sum stays inside (before: always the network)."""
    hw = get_hardware("a100-80gb")
    flat = dataclasses.replace(hw, network_gb_s=hw.nvlink_gb_s)       # the same hardware, no slower link
    crossing = dict(tp=4, cp=2, pp=2, dp=1)
    assert _breakdown(hw, **crossing)["p2p"] > _breakdown(flat, **crossing)["p2p"]
    inside = dict(tp=1, pp=2, dp=1)
    assert _breakdown(hw, **inside)["dp_comm"] == _breakdown(flat, **inside)["dp_comm"]
    assert _breakdown(hw, **inside)["p2p"] == _breakdown(flat, **inside)["p2p"]
