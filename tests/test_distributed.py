"""Data parallelism on CPU (gloo, 2 processes): the update of N ranks is the update one process makes on
the global batch. Each rank holds whole groups; the denominators, the skip decision and the gradients
are summed over the ranks (``grpolab.distributed``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_update import ToyPolicy, make_data

from grpolab.algorithms import PRESETS
from grpolab.distributed import Ranks
from grpolab.update import UpdateData, run_update

GROUPS, G, T = 4, 4, 9
# per rollout batch, the groups whose rewards are all equal: batch 2 has no signal anywhere (skipped on
# every rank), batch 3 none on rank 1 of 2 (it joins with zero gradients)
ZERO_GROUPS = ((0,), tuple(range(GROUPS)), (2, 3))


def updates(name: str, ranks: Ranks) -> dict:
    """Three rollout batches' updates of a float64 toy policy; this rank's whole groups only."""
    spec = PRESETS[name]
    policy = ToyPolicy(GROUPS * G, T, seed=1)
    optimizer = torch.optim.AdamW([policy.weight], lr=0.05)
    rows = torch.tensor([g * G + j for g in ranks.groups(GROUPS) for j in range(G)])
    out = {"actual": [], "grad_norms": []}
    for batch, zero in enumerate(ZERO_GROUPS):
        data = make_data(policy, seed=10 + batch, groups=GROUPS, group_size=G, spec=spec, zero_groups=zero)
        local = UpdateData(advantages=data.advantages[rows], response_mask=data.response_mask[rows],
                           old_logprobs=data.old_logprobs[rows], ref_logprobs=data.ref_logprobs[rows])
        result = run_update(spec, local, lambda idx: policy(rows[idx]), optimizer, [policy.weight],
                            micro_batch_size=3, max_new_tokens=T, reduce=ranks.reduce)
        out["actual"].append(result.actual)
        out["grad_norms"] += result.grad_norms
    out["weight"] = policy.weight.detach().clone()
    return out


def _rank(rank: int, world: int, init_file: str, out_dir: str, name: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.save(updates(name, Ranks.current()), f"{out_dir}/{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ["grpo", "cispo", "dr_grpo"])  # sequence, token, constant aggregation
def test_two_ranks_make_the_single_process_update(name, tmp_path):
    mp.spawn(_rank, args=(2, str(tmp_path / "init"), str(tmp_path), name), nprocs=2, join=True)
    single = updates(name, Ranks())
    assert single["actual"][1] == 0 and single["actual"][0] > 0 and single["actual"][2] > 0
    for rank in (0, 1):
        ranked = torch.load(tmp_path / f"{rank}.pt")
        assert ranked["actual"] == single["actual"]
        assert ranked["grad_norms"] == pytest.approx(single["grad_norms"], rel=1e-9)
        torch.testing.assert_close(ranked["weight"], single["weight"], rtol=0, atol=1e-6)
    assert not torch.equal(single["weight"], ToyPolicy(GROUPS * G, T, seed=1).weight)


def test_groups_are_whole_and_even():
    assert [list(Ranks(r, 2).groups(4)) for r in (0, 1)] == [[0, 1], [2, 3]]
    assert list(Ranks().groups(3)) == [0, 1, 2] and Ranks().reduce is None
    with pytest.raises(ValueError, match="cannot be split evenly"):
        Ranks(0, 2).groups(3)
