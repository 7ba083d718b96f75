"""Data parallelism on CPU: the update of N ranks is the update one process makes on the global batch.
Each rank holds whole groups; the denominators and the skip decision are agreed over the ranks, and DDP
sums the gradients (``grpolab.parallel.ranks``). The ranks run as threads of this process (torch's
in-process process group: the same DDP and collectives, in seconds); as 2 gloo processes in ``slow``, and
the whole trainer under ``torchrun`` in test_torchrun.py."""

from __future__ import annotations

import faulthandler
import gc

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_update import ToyPolicy, make_data
from threaded_ranks import run_as_threads

from grpolab.learning.lockstep import UpdateLockstep
from grpolab.learning.update import Trainee, UpdateData, UpdateHooks, UpdateSchedule, run_update
from grpolab.objectives.presets import PRESETS
from grpolab.objectives.token_selection import AdaptiveEntropy
from grpolab.parallel.ranks import Ranks, wrap_ddp

GROUPS, G, T = 4, 4, 9
# per rollout batch, the groups whose rewards are all equal: batch 2 has no signal anywhere (skipped on
# every rank), batch 3 none on rank 1 of 2 (it joins with zero gradients)
ZERO_GROUPS = ((0,), tuple(range(GROUPS)), (2, 3))


class _ToyModule(torch.nn.Module):
    """The toy policy as a module, so that DDP can wrap it: rows [k] -> (log-probs, entropy) [k, T]."""

    def __init__(self, policy: ToyPolicy):
        super().__init__()
        self.policy, self.weight = policy, policy.weight

    def forward(self, rows: torch.Tensor):
        return self.policy(rows)


def updates(name: str, ranks: Ranks, **overrides) -> dict:
    """Three rollout batches' updates of a float64 toy policy; this rank's whole groups only."""
    spec = PRESETS[name].model_copy(update=overrides)
    policy = ToyPolicy(GROUPS * G, T, seed=1)
    module = _ToyModule(policy)
    forward = wrap_ddp(module, torch.device("cpu")) if ranks.parallel else module
    optimizer = torch.optim.AdamW([policy.weight], lr=0.05)
    lockstep = UpdateLockstep(ranks, forward, sharded=False)  # as the learner agrees with the other ranks
    part = lockstep.part(GROUPS, G)
    rows = torch.tensor(list(part.rows))
    dp = lockstep.share(part)
    out = {"actual": [], "grad_norms": [], "metrics": []}
    gen = torch.Generator().manual_seed(3)
    control = AdaptiveEntropy()  # the adaptive entropy coefficient, carried over the batches as a run does
    for batch, zero in enumerate(ZERO_GROUPS):
        data = make_data(policy, seed=10 + batch, groups=GROUPS, group_size=G, spec=spec, zero_groups=zero)
        local = UpdateData(
            advantages=data.advantages[rows],
            response_mask=data.response_mask[rows],
            old_logprobs=data.old_logprobs[rows],
            ref_logprobs=data.ref_logprobs[rows],
            teacher_logprobs=None if data.teacher_logprobs is None else data.teacher_logprobs[rows],
        )
        result = run_update(
            spec,
            local,
            Trainee(lambda idx: forward(rows[idx]), optimizer, [policy.weight]),
            UpdateSchedule(micro_batch_size=3, max_new_tokens=T, generator=gen),
            UpdateHooks(dp=dp, entropy_control=control),
        )
        out["actual"].append(result.actual)
        out["grad_norms"] += result.grad_norms
        out["metrics"].append(result.metrics())
    out["weight"] = policy.weight.detach().clone()
    return out


def _rank(rank: int, world: int, init_file: str, out_dir: str, name: str, overrides: dict) -> None:
    faulthandler.enable(all_threads=True)  # an abort in a rank prints where each thread was
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.save(updates(name, Ranks.current(), **overrides), f"{out_dir}/{rank}.pt")
        dist.barrier()  # neither rank tears its group down while the other still uses it
    finally:
        gc.collect()  # DDP's reducer goes before its process group, or its thread aborts the process
        dist.destroy_process_group()


def assert_single_process_update(ranked_updates: list[dict], name: str, overrides: dict) -> None:
    single = updates(name, Ranks(), **overrides)
    # the entropy bonus and KL-Cov's penalty (on its top tokens, all of covariance 0) have a gradient without signal
    bonus = overrides.get("entropy_coef", 0) > 0 or overrides.get("use_adaptive_entropy", False) or name == "kl_cov"
    # batch 1 has no task signal: skipped, but by distillation (its teacher's signal is on every token)
    if PRESETS[name].needs_teacher:
        assert single["actual"][1] > 0
    elif not bonus:
        assert single["actual"][1] == 0
    assert single["actual"][0] > 0 and single["actual"][2] > 0
    assert len(ranked_updates) == 2
    for ranked in ranked_updates:
        assert ranked["actual"] == single["actual"]
        assert ranked["grad_norms"] == pytest.approx(single["grad_norms"], rel=1e-9)
        torch.testing.assert_close(ranked["weight"], single["weight"], rtol=0, atol=1e-6)
        for got, want in zip(ranked["metrics"], single["metrics"]):  # every rank logs the global step's metrics
            assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert not torch.equal(single["weight"], ToyPolicy(GROUPS * G, T, seed=1).weight)


# sequence, token and constant aggregation; cispo's 4 epochs and offpolicy's shuffled mini-batches, where
# a rank may hold no row of an optimizer step; bnpo's batch-wide Beta fit and sequence_sum, vespo's sequence weight,
# lite_ppo's batch-std advantages (formed over the global batch);
# token selection over the whole step (all ranks): 80/20, Clip-Cov's draw, KL-Cov's penalty, the adaptive entropy;
# opd's per-token advantages from a teacher (every row trains)
ALGORITHMS = pytest.mark.parametrize(
    "name, overrides",
    [
        ("grpo", {}),
        ("cispo", {}),
        ("dr_grpo", {}),
        ("offpolicy_clip", {"steps_per_epoch": 4}),
        ("bnpo", {}),
        ("vespo", {}),
        ("lite_ppo", {}),
        ("dapo_8020", {"entropy_coef": 0.02}),
        ("clip_cov", {"steps_per_epoch": 2, "clip_cov_ratio": 0.15, "clip_cov_lb": 0.0, "clip_cov_ub": 0.5}),
        ("kl_cov", {"steps_per_epoch": 4, "kl_cov_ratio": 0.1}),
        ("grpo", {"use_adaptive_entropy": True, "entropy_coef_delta": 0.1, "entropy_target": 5.0}),
        ("opd", {}),
    ],
)


@ALGORITHMS
def test_two_ranks_make_the_single_process_update(name, overrides):
    ranked = run_as_threads(2, lambda rank: (Ranks.current(), updates(name, Ranks.current(), **overrides)))
    assert [ranks for ranks, _ in ranked] == [Ranks(0, 2), Ranks(1, 2)]
    assert_single_process_update([update for _, update in ranked], name, overrides)


@pytest.mark.slow  # ~15 s a case: two interpreters; the threads above run the same DDP and collectives
@ALGORITHMS
def test_two_gloo_processes_make_the_single_process_update(name, overrides, tmp_path):
    mp.spawn(_rank, args=(2, str(tmp_path / "init"), str(tmp_path), name, overrides), nprocs=2, join=True)
    assert_single_process_update([torch.load(tmp_path / f"{rank}.pt") for rank in (0, 1)], name, overrides)


def test_groups_are_whole_and_even():
    assert [list(Ranks(r, 2).groups(4)) for r in (0, 1)] == [[0, 1], [2, 3]]
    assert list(Ranks().groups(3)) == [0, 1, 2] and not Ranks().parallel
    assert [list(Ranks(r, 3).share(7)) for r in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [list(Ranks(r, 2).share_chunks(7, 2)) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6]]
    assert [list(Ranks(r, 2).share_chunks(3, 4)) for r in range(2)] == [[0, 1, 2], []]
    with pytest.raises(ValueError, match="cannot be split evenly"):
        Ranks(0, 2).groups(3)


def test_the_lockstep_part_gives_each_rank_whole_groups_and_its_share_of_the_update():
    """Rank 1 of 2 (no process group: nothing here is a collective): its groups, its rows of the global batch,
    and the share the update runs as; FSDP pads every forward to the busiest rank's; one process has no share."""
    module = torch.nn.Linear(2, 2)
    lockstep = UpdateLockstep(Ranks(1, 2), module, sharded=False)
    part = lockstep.part(4, 8)
    assert (part.groups, part.rows, part.n_rows) == (range(2, 4), range(16, 32), 32)
    assert part.of(["a", "b", "c", "d"]) == ["c", "d"]
    assert part.of(torch.arange(8).view(4, 2)).tolist() == [[4, 5], [6, 7]]
    share = lockstep.share(part)
    assert (share.rows, share.n_rows, share.lockstep, lockstep.forwards) == (range(16, 32), 32, False, None)
    assert share.local(torch.tensor([3, 16, 31, 17])).tolist() == [0, 15, 1]
    # DDP: a rank with nothing to backpropagate still joins the all-reduce with one backward
    assert share.forwards(0, 2, backward=True) == (1, 2) and share.forwards(0, 2, backward=False) == (0, 2)
    sharded = UpdateLockstep(Ranks(1, 2), module, sharded=True)
    assert sharded.share(part).lockstep and sharded.forwards == Ranks(1, 2)
    alone = UpdateLockstep(Ranks(), module, sharded=False)
    assert alone.share(alone.part(4, 8)) is None and alone.part(4, 8).rows == range(32)
    assert alone.sum_counts({"tokens": 3}) == {"tokens": 3} and alone.total(torch.ones(2)).tolist() == [1.0, 1.0]
    rows = torch.ones(2, 3)
    assert alone.global_rows(rows)[0] is rows
    with pytest.raises(ValueError, match="cannot be split evenly"):
        lockstep.part(3, 8)


def test_torchrun_on_gpus_joins_nccl_on_the_local_device(monkeypatch):
    """The CUDA path, which cannot run here, through call-recording stand-ins of torch's functions: NCCL,
    each rank on its LOCAL_RANK device, the collectives' tensors moved there and back."""
    import grpolab.parallel.ranks as D

    calls = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(D.dist, "is_initialized", lambda: bool(calls))
    monkeypatch.setattr(D.dist, "init_process_group", lambda backend, timeout: calls.append(("init", backend, timeout)))
    monkeypatch.setattr(D.torch.cuda, "set_device", lambda device: calls.append(("set_device", str(device))))
    monkeypatch.setattr(D.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(D.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(D.dist, "get_backend", lambda: "nccl")
    monkeypatch.setattr(D.torch.cuda, "current_device", lambda: 1)
    ranks, device = D.init_from_env(torch.device("cuda"), timeout_minutes=7)
    assert calls[0] == ("set_device", "cuda:1") and calls[1][:2] == ("init", "nccl")
    assert calls[1][2].total_seconds() == 7 * 60
    assert str(device) == "cuda:1" and ranks == Ranks(1, 2, "cuda:1")

    moved = []  # the device each reduced tensor was sent to

    def fake_all_reduce(tensor, op):
        moved.append(tensor.device_hint)
        tensor.add_(1)

    original_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        out = original_to(self, "cpu")
        out.device_hint = args[0] if args else kwargs.get("device")
        return out

    monkeypatch.setattr(D.dist, "all_reduce", fake_all_reduce)
    monkeypatch.setattr(torch.Tensor, "to", to)
    counts = torch.tensor([1.0, 2.0])
    assert ranks.sum_(counts) is counts and counts.tolist() == [2.0, 3.0] and moved == ["cuda:1"]


def test_ddp_buffer_sync_keyword_matches_the_installed_torch(monkeypatch):
    """torch 2.13 names it forward_sync_buffers; torch 2.11 (the GPU image) only has broadcast_buffers."""
    from grpolab.parallel.ranks import no_forward_buffer_sync

    new_keyword = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 13)
    assert no_forward_buffer_sync() == (
        {"forward_sync_buffers": False} if new_keyword else {"broadcast_buffers": False}
    )

    class OldDDP:  # the torch 2.11 signature's keywords, recording the call
        def __init__(self, module, device_ids=None, output_device=None, dim=0, broadcast_buffers=True):
            self.calls = {"broadcast_buffers": broadcast_buffers}

    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", OldDDP)
    assert no_forward_buffer_sync() == {"broadcast_buffers": False}


@pytest.mark.parametrize("root_reshards", [True, False])
def test_a_sharded_root_drops_its_gathered_weights_after_each_optimizer_step_before_torch_2_13(
    monkeypatch, root_reshards
):
    """Before torch 2.13 the FSDP root keeps its whole weights from forward to backward; a forward with no
    backward after it (a frozen or padding forward) would leave them gathered into the next optimizer
    step, and the forward after that step would use them stale. ``drop_stale_weights`` reshards then."""
    import grpolab.parallel.fsdp as sharding

    class Root(torch.nn.Linear):  # records FSDPModule.reshard calls
        reshards = 0

        def reshard(self):
            self.reshards += 1

    monkeypatch.setattr(sharding, "ROOT_RESHARDS_AFTER_FORWARD", root_reshards)
    monkeypatch.setattr(sharding, "is_sharded", lambda model: True)
    root = Root(2, 2)
    optimizer = torch.optim.SGD(root.parameters(), lr=0.1)
    optimizer.register_step_post_hook(lambda *_: sharding.drop_stale_weights(root))  # as the learner does
    root(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    optimizer.step()
    assert root.reshards == (0 if root_reshards else 2)
