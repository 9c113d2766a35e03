"""GPU tier: the DD-PPO loop (kfuse.rl) trains alike with kfuse's encoder and with plain PyTorch's, both fp16 on CUDA
(skipped without a CUDA GPU).

Tolerance, from the data: two plain-PyTorch runs that differ only in cuDNN's algorithms (NCHW with the heuristics'
choice; channels-last with cudnn.benchmark: cudnn.benchmark alone picked the very same kernels on an H200) give the
fp16 noise of this loop (rounding in other orders, and the sampled actions that a logit moved by that
rounding flips). kfuse's run must stay within 3x that noise of the first plain run, losses per iteration and
weights after the run, with a floor of 1e-3 relative for losses (two fp16 roundings of an O(1) value: 2 x 2^-11) and
1e-3 for the weights (the Adam steps of a few iterations, each ~lr = 5e-4 per element, rounded to fp16)."""

import pytest
import torch

import kfuse
from kfuse import rl
from kfuse.bench_rl import agreement

pytestmark = pytest.mark.skipif(not kfuse.cuda_available(), reason="needs a CUDA GPU and a CUDA build of kfuse")

ITERATIONS, ENVS, STEPS, SEED = 4, 16, 8, 11


def test_kfuse_and_plain_pytorch_encoders_train_alike_in_fp16():
    a = agreement(ITERATIONS, ENVS, STEPS, SEED)
    noise_loss = max(a["loss_noise"])
    for i, err in enumerate(a["loss_diff"]):
        assert err <= max(3 * noise_loss, 1e-3), (f"iteration {i}: loss {a['loss_kfuse'][i]} against "
                                                   f"{a['loss_torch'][i]} (relative {err:.2e}; plain-PyTorch noise "
                                                   f"{noise_loss:.2e})")
    err_w, noise_w = a["weight_diff"], a["weight_noise"]
    assert err_w <= max(3 * noise_w, 1e-3), f"weights off by {err_w:.2e} (plain-PyTorch noise {noise_w:.2e})"
    # The comparison means something only where the updates moved the weights by more than the discrepancy allowed.
    assert a["weight_moved"] >= 3 * max(err_w, noise_w), f"the updates moved the weights by {a['weight_moved']:.2e} only"



def _rollout_inputs(n: int, gen: torch.Generator):
    frames = torch.randint(0, 256, (n, 64, 64, 4), generator=gen, device="cuda", dtype=torch.uint8)
    goal = torch.rand(n, 3, generator=gen, device="cuda") * 2 - 1
    prev_action = torch.randint(0, rl.NUM_ACTIONS + 1, (n,), generator=gen, device="cuda")
    h = (torch.randn(2, n, rl.HIDDEN, generator=gen, device="cuda") * 0.5).half()
    c = (torch.randn(2, n, rl.HIDDEN, generator=gen, device="cuda") * 0.5).half()
    mask = (torch.rand(n, generator=gen, device="cuda") > 0.1).float()
    u = torch.rand(n, generator=gen, device="cuda")
    return frames, goal, prev_action, (h, c), mask, u


def _flat(out):
    """(actions, every other output as one float vector)"""
    action, logprob, value, (h, c) = out
    return action, torch.cat([logprob.float(), value.float(), h.float().flatten(), c.float().flatten()])


STEP_TOL = 2e-3  # normwise: the same kernels, a few fp16 roundings (2^-11 each) where cuBLAS picks another split


@pytest.mark.parametrize("encoder", ["kfuse", "torch"])
def test_graphed_actor_follows_every_weight_and_statistics_change(encoder):
    """The benchmark's graphed rollout step (kfuse.rl.GraphedActor) against the eager Actor on fresh inputs: through
    warm-up and capture, after every parameter was written through .data.copy_ (the trainer's write-back, no version
    bump) and after the observation statistics moved (folded into kfuse's stem on the host before each call). Each
    change is checked to move the eager outputs by far more than STEP_TOL, so a replay that kept old weights or old
    statistics fails (the graphed step runs before the eager one, which would bring the encoder's device state up to
    date for it). Actions: drawn by inverting the CDF at the same u, equal but where a rounding moves the CDF
    across u (at most 2 of 128)."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    policy = rl.Policy(encoder=encoder, seed=5).cuda().half().eval()
    eager, graphed = rl.Actor(policy), rl.GraphedActor(rl.Actor(policy), warmup=2)

    def compare(label, args):
        # The graphed step first: an eager call of the same encoder would bring the device's state up to date for it.
        a_got, got = _flat(graphed(*args))
        a_want, want = _flat(eager(*args))
        err = ((got - want).norm() / want.norm()).item()
        assert err <= STEP_TOL, f"{label}: the graphed step is off by {err:.2e}"
        assert (a_got != a_want).sum().item() <= 2, f"{label}: actions differ"
        return want

    def moved(after, before, what):
        change = ((after - before).norm() / before.norm()).item()
        assert change > 10 * STEP_TOL, f"{what} moved the outputs by {change:.2e} only: the check would not see it"

    with torch.no_grad():
        for i in range(3):  # two eager warm-up calls, then the capture
            compare(f"call {i}", _rollout_inputs(128, gen))
        assert graphed.graph is not None, "no graph after the warm-up calls"
        args = _rollout_inputs(128, gen)
        before = compare("replay", args)
        for p in policy.parameters():
            p.data.copy_(p.float() * (1 + 0.2 * torch.randn(p.shape, generator=gen, device="cuda")))
        after = compare("after .data.copy_ of every parameter", args)
        moved(after, before, "the write")
        dark = torch.randint(0, 64, (64, 64, 64, 4), generator=gen, device="cuda", dtype=torch.uint8)
        for _ in range(20):
            policy.obs_norm.update(dark)
        moved(compare("after the observation statistics moved", args), after, "the statistics' update")
        # Another shape runs eagerly, and the graph stays for the captured one.
        small = _rollout_inputs(8, gen)
        torch.testing.assert_close(_flat(graphed(*small))[1], _flat(eager(*small))[1], rtol=0, atol=0)
        compare("a replay after an eager call of another shape", _rollout_inputs(128, gen))


def _state(trainer):
    """Every tensor an update changes (masters, parameters, Adam's state, the GradScaler's scale and tracker), and
    copies of them: restoring copies them back in place, so that a captured graph still reads the same memory."""
    opt = [t for st in trainer.optimizer.state.values() for t in st.values() if torch.is_tensor(t)]
    live = [*trainer.masters, *(p.data for p in trainer.params), *opt, trainer.scaler._scale,
            trainer.scaler._growth_tracker]
    return live, [t.detach().clone() for t in live]


@pytest.mark.parametrize("encoder", ["kfuse", "torch"])
def test_graphed_update_equals_the_eager_update_on_the_same_state(encoder):
    """kfuse.rl.GraphedUpdate (the update as one CUDA graph) against the same trainer's eager update from the same
    state, after two eager warm-up updates and the capture, on two fresh rollouts (the graph must read the storage
    the rollout refilled in place): the loss terms to 1e-3 relative, the fp32 masters to 1e-2 of what the update
    moved them by (the same kernels; fp16 rounding where cuBLAS or cuDNN pick another algorithm inside a capture).
    The update must have moved them. Before each graphed update the statistics and every weight move by far more
    than the tolerances (a replay that read stale storage, weights or kfuse's old normalization fold would show);
    the eager reference folds the statistics in its forward."""
    torch.manual_seed(0)
    policy = rl.Policy(encoder=encoder, seed=6).cuda().half()
    trainer = rl.PPOTrainer(policy, num_envs=16, steps=8, seed=6)
    graphed = rl.GraphedUpdate(trainer, warmup=2)
    assert trainer.update is graphed
    for _ in range(2):  # eager warm-up updates
        trainer.rollout()
        trainer.update()
    assert graphed.graph is None
    gen = torch.Generator(device="cuda").manual_seed(7)
    for it in range(3):  # the capture, then replays
        trainer.rollout()
        # Large moves of what the graph must read afresh: the statistics (folded into kfuse's stem on the host) and
        # every weight (masters and parameters together), so that a stale read changes the results by O(1).
        norm = policy.obs_norm
        norm.mean.add_(0.2 * (it + 1))
        norm.var.mul_(2.0)
        norm.version += 1
        with torch.no_grad():
            for m, p in zip(trainer.masters, trainer.params):
                m.mul_(1 + 0.3 * torch.randn(m.shape, generator=gen, device="cuda"))
                p.data.copy_(m)
        live, saved = _state(trainer)
        got = trainer.update()
        assert graphed.graph is not None
        masters_graph = torch.cat([m.detach().flatten() for m in trainer.masters])
        for t, v in zip(live, saved):
            t.copy_(v)
        want = dict(zip(rl.UPDATE_STATS, trainer.update_tensors().tolist()))
        masters_eager = torch.cat([m.detach().flatten() for m in trainer.masters])
        before = torch.cat([v.flatten() for v in saved[: len(trainer.masters)]])
        moved = (masters_eager - before).norm().item()
        assert moved > 0, f"iteration {it}: the update did not move the weights"
        for key in rl.UPDATE_STATS:
            assert abs(got[key] - want[key]) <= 1e-3 * max(1.0, abs(want[key])), (it, key, got[key], want[key])
        off = (masters_graph - masters_eager).norm().item()
        assert off <= 1e-2 * moved, f"iteration {it}: masters off by {off:.2e} for a move of {moved:.2e}"
