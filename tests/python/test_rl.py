"""CPU tier: the DD-PPO-shaped training loop (kfuse.rl) on small problems: deterministic under a seed, and the same
losses and weights with kfuse's encoder as with plain PyTorch's (both float32 on the CPU: kfuse's C++ reference,
float32 storage with float64 sums, against PyTorch's float32 convolutions)."""

import pytest
import torch

from kfuse import rl


def _run(encoder: str, iterations: int = 2, seed: int = 3):
    policy = rl.Policy(encoder=encoder, seed=seed)
    trainer = rl.PPOTrainer(policy, num_envs=4, steps=3, seed=seed)
    stats = [trainer.iteration() for _ in range(iterations)]
    return stats, policy


def _flat(policy):
    return torch.cat([p.detach().flatten() for p in policy.parameters()])


def test_the_loop_is_deterministic_under_a_seed():
    a, pa = _run("kfuse")
    b, pb = _run("kfuse")
    assert a == b
    assert torch.equal(_flat(pa), _flat(pb))


def test_kfuse_and_plain_pytorch_encoders_train_alike():
    (k, pk), (t, pt) = _run("kfuse"), _run("torch")
    for sk, st in zip(k, t):
        for name in sk:
            assert abs(sk[name] - st[name]) <= 1e-4 * max(1.0, abs(st[name])), (name, sk[name], st[name])
    wk, wt = _flat(pk), _flat(pt)
    assert (wk - wt).norm() <= 1e-5 * wt.norm()
    assert not torch.equal(wt, _flat(rl.Policy(encoder="torch", seed=3)))  # the update moved the weights


def test_gae_matches_a_direct_computation():
    gen = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(5, 2, generator=gen), torch.randn(6, 2, generator=gen)
    masks = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    got = rl.compute_gae(rewards, values, masks, 0.99, 0.95)
    for j in range(2):
        for t in range(5):
            adv, discount = 0.0, 1.0
            for u in range(t, 5):
                delta = rewards[u, j] + 0.99 * values[u + 1, j] * masks[u + 1, j] - values[u, j]
                adv += discount * delta
                discount *= 0.99 * 0.95 * masks[u + 1, j]
            assert abs(got[t, j] - (adv + values[t, j])) < 1e-5


@pytest.mark.parametrize("impl", ["kfuse", "torch-jit-fp16"])
def test_bench_rl_configurations_run_and_agree(impl):
    """The rl benchmark's configurations (kfuse.bench_rl) run a PPO iteration on the CPU (float32, 2 environments x 2
    steps) with the losses of the plain eager policy from the same seed (float32 sums in another order: 1e-4), and
    report frames per second."""
    from kfuse import bench_rl

    trainer = bench_rl._trainer(impl, "cpu", num_envs=2, steps=2, seed=3, dtype=torch.float32)
    eager = bench_rl._trainer("torch-eager", "cpu", num_envs=2, steps=2, seed=3, dtype=torch.float32)
    got, want = trainer.iteration(), eager.iteration()
    for key in ("loss", "value_loss", "entropy"):
        assert abs(got[key] - want[key]) <= 1e-4 * max(1.0, abs(want[key])), key
    r = bench_rl.time_iterations(trainer, iterations=1, warmup=0)
    assert r["fps"] > 0 and r["frames_per_iteration"] == 4 and r["gpus"] == 1
