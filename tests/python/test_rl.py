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


def _stepped_lstm(rnn, z, hidden, masks, n):
    """The definition masked_lstm must equal: one LSTM step per time step, the state times the mask before it."""
    h, c = hidden
    outs = []
    for t in range(z.shape[0] // n):
        m = masks[t * n:(t + 1) * n].to(z.dtype).view(1, n, 1)
        o, (h, c) = rnn(z[t * n:(t + 1) * n].unsqueeze(0), (h * m, c * m))
        outs.append(o.squeeze(0))
    return torch.cat(outs, 0), (h, c)


@pytest.mark.parametrize("steps", [1, 2, 7])
def test_masked_lstm_over_episode_pieces_equals_stepping_it(steps):
    """One packed call over the episode pieces against T masked steps (float64): outputs, the final state and the
    gradients of the inputs, the initial state and every LSTM weight. The masks hold resets at the first step, an
    environment that never resets, one that resets at every step and random ones."""
    torch.manual_seed(steps)
    n, feat, hid = 5, 6, 4
    rnn = torch.nn.LSTM(feat, hid, num_layers=2).double()
    masks = (torch.rand(steps, n) > 0.35).double()
    masks[:, 0], masks[:, 1] = 1, 0
    masks[0, 2] = 0
    masks = masks.reshape(-1)
    z = torch.randn(steps * n, feat, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(2, n, hid, dtype=torch.float64, requires_grad=True)
    c0 = torch.randn(2, n, hid, dtype=torch.float64, requires_grad=True)
    results = []
    stepped = lambda *args: rl.masked_lstm(*args, stepped=True)  # noqa: E731 (the form a CUDA graph holds)
    for fn in (rl.masked_lstm, _stepped_lstm, stepped):
        o, (h, c) = fn(rnn, z, (h0, c0), masks, n)
        w = torch.randn_like(o, generator=torch.Generator().manual_seed(1))
        loss = (o * w).sum() + (h * 0.5).sum() + (c * 0.25).sum()
        grads = torch.autograd.grad(loss, [z, h0, c0, *rnn.parameters()])
        results.append((o, h, c, *grads))
    for other in results[1:]:
        for got, want in zip(results[0], other):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("steps", [2, 7])
def test_padded_pieces_give_the_packed_outputs_and_gradients(steps):
    """masked_lstm(final_state=False), the update's call: the pieces padded to the longest instead of packed. The
    padding steps follow each piece's outputs and nothing reads them, so the outputs and the gradients of the
    inputs, the initial state and every weight equal the packed call's (float64: the same per-sequence arithmetic,
    other batch sizes per step)."""
    torch.manual_seed(10 + steps)
    n, feat, hid = 6, 5, 3
    rnn = torch.nn.LSTM(feat, hid, num_layers=2).double()
    masks = (torch.rand(steps, n) > 0.4).double()
    masks[:, 0], masks[:, 1] = 1, 0
    masks = masks.reshape(-1)
    z = torch.randn(steps * n, feat, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(2, n, hid, dtype=torch.float64, requires_grad=True)
    c0 = torch.randn(2, n, hid, dtype=torch.float64, requires_grad=True)
    w = torch.randn(steps * n, hid, dtype=torch.float64)
    results = []
    for final_state in (True, False):
        o, state = rl.masked_lstm(rnn, z, (h0, c0), masks, n, final_state)
        assert (state is None) == (not final_state)
        grads = torch.autograd.grad((o * w).sum(), [z, h0, c0, *rnn.parameters()])
        results.append((o, *grads))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_episode_pieces_of_a_small_case():
    masks = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])  # (T=3, n=2): env 0 resets at t=1, env 1 at t=0
    p = rl.episode_pieces(masks)
    assert p["env"].tolist() == [0, 0, 1] and p["lengths"].tolist() == [1, 2, 3]
    assert p["first"].tolist() == [True, False, True] and p["last"].tolist() == [1, 2]


def test_actor_samples_actions_with_the_policys_probabilities():
    """The rollout step's sampling (the cumulative distribution inverted at uniform numbers): frequencies over 200,000
    draws within 5 standard deviations of the softmax probabilities, log-probabilities those of Categorical, and the
    PPO terms (ratio, entropy) those of torch.distributions.Categorical."""
    n, gen = 200_000, torch.Generator().manual_seed(0)
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0]]).expand(n, 4).contiguous()

    class Fixed(torch.nn.Module):
        def forward(self, frames, goal, prev_action, hidden, mask):
            return logits, torch.zeros(n), hidden

    actor = rl.Actor(rl.Policy(encoder="torch"))
    actor.policy = Fixed()
    action, logprob, _, _ = actor(None, None, None, None, None, torch.rand(n, generator=gen))
    p = logits[0].softmax(0)
    freq = torch.bincount(action, minlength=4).double() / n
    assert ((freq - p).abs() <= 5 * (p * (1 - p) / n).sqrt()).all(), (freq, p)
    dist = torch.distributions.Categorical(logits=logits)
    torch.testing.assert_close(logprob, dist.log_prob(action))
    old = logprob - 0.1 * torch.rand(n, generator=gen)
    ratio, entropy = rl.ppo_terms(logits, action, old)
    torch.testing.assert_close(ratio, torch.exp(dist.log_prob(action) - old))
    torch.testing.assert_close(entropy, dist.entropy())


def test_compiled_rollout_step_equals_eager():
    """The rollout step compiled as the rl benchmark's compiled rows compile it (Dynamo's RNN support on): actions,
    log-probabilities, values and the recurrent state (its shape included: the traced LSTM returned the states with
    an extra dimension) equal eager's, float64 on the CPU."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    actor = rl.Actor(rl.Policy(encoder="torch").double().eval())
    n, gen = 3, torch.Generator().manual_seed(1)
    args = (torch.randint(0, 256, (n, 64, 64, 4), generator=gen, dtype=torch.uint8),
            torch.rand(n, 3, generator=gen, dtype=torch.float64), torch.randint(0, 5, (n,), generator=gen),
            (torch.randn(2, n, 512, generator=gen, dtype=torch.float64),
             torch.randn(2, n, 512, generator=gen, dtype=torch.float64)),
            torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64), torch.rand(n, generator=gen, dtype=torch.float64))
    with torch.no_grad(), torch._dynamo.config.patch(allow_rnn=True):
        want, got = actor(*args), torch.compile(actor, fullgraph=True)(*args)
    assert torch.equal(got[0], want[0])
    for a, b in zip((*got[1:3], *got[3]), (*want[1:3], *want[3])):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


def test_data_parallel_benchmark_runs_over_two_processes(tmp_path):
    """kfuse bench's weak-scaling run (bench_rl.run_rl_ddp) on the CPU with gloo: one process, then two, each with its
    own environments; frames/s counts every rank's frames; the JSON is written."""
    import argparse
    import json

    from kfuse import bench_rl

    args = argparse.Namespace(impl=None, rl_iters=1, rl_envs=2)
    (title, rows), = bench_rl.run_rl_ddp(args, {"device": "cpu"}, tmp_path, 2, device_type="cpu", steps=2)
    assert [r["gpus"] for r in rows] == [1, 2]
    assert rows[1]["frames_per_iteration"] == 2 * rows[0]["frames_per_iteration"] == 8
    assert rows[1]["scaling"] > 0 and rows[1]["update_vs_one"] > 0
    assert json.loads((tmp_path / "rl-ddp2-c3.json").read_text())["meta"]["backend"] == "gloo"


def test_data_parallel_frames_per_second_count_an_iteration_once():
    """The weak-scaling row (bench_rl.combine_ranks): ranks start each iteration together, so an iteration lasts as
    long as its slowest rank's. Here rank 0's rollout ends 30 ms before rank 1's and its update (which waits at the
    first all-reduce for rank 1) takes 30 ms longer: both ranks' iterations last 100 ms. Adding the slowest rollout
    (60) to the slowest update (70), as the first version did, counted that wait twice (130 ms)."""
    from kfuse import bench_rl

    ranks = [{"rollouts_ms": [30.0, 30.0, 30.0], "iterations_ms": [100.0, 100.0, 100.0], "frames_per_iteration": 4096},
             {"rollouts_ms": [60.0, 60.0, 60.0], "iterations_ms": [100.0, 100.0, 100.0], "frames_per_iteration": 4096}]
    row = bench_rl.combine_ranks(ranks)
    assert row["iteration_ms"] == 100.0
    assert row["fps"] == 8192 / 0.1
    assert row["rollout_ms"] == 60.0 and row["update_ms"] == 40.0
    # One slow iteration on one rank is one slow iteration, not a slow median.
    ranks[1]["iterations_ms"] = [100.0, 250.0, 100.0]
    assert bench_rl.combine_ranks(ranks)["iteration_ms"] == 100.0


def test_graphed_actor_refuses_gradients_and_a_capture_without_warm_up():
    """GraphedActor's rollout step has no autograd graph: a call with gradients enabled is refused by name (before any
    CUDA work), as is a capture with no eager warm-up call before it."""
    policy = rl.Policy(encoder="torch", seed=0)
    actor = rl.GraphedActor(rl.Actor(policy))
    hidden = policy.initial_hidden(2)
    args = (torch.zeros(2, 64, 64, 4, dtype=torch.uint8), torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), hidden,
            torch.ones(2), torch.rand(2))
    with pytest.raises(RuntimeError, match="torch.no_grad"):
        actor(*args)
    with pytest.raises(ValueError, match="warm-up"):
        rl.GraphedActor(rl.Actor(policy), warmup=0)


def test_update_tensors_is_the_update_and_the_stepped_lstm_trains_alike():
    """update() is update_tensors() read back; a policy whose update steps its LSTM (what GraphedUpdate runs) trains
    like the packed one from the same seed (float32 on the CPU: other summation orders, 1e-5), and GraphedUpdate
    refuses a trainer it cannot capture, by name."""
    def run(stepped):
        policy = rl.Policy(encoder="torch", seed=4)
        policy.stepped_lstm = stepped
        trainer = rl.PPOTrainer(policy, num_envs=3, steps=4, seed=4)
        out = []
        for _ in range(2):
            trainer.rollout()
            out.append(trainer.update())
        return out, torch.cat([m.detach().flatten() for m in trainer.masters])

    (packed, w_packed), (stepped, w_stepped) = run(False), run(True)
    for a, b in zip(packed, stepped):
        assert list(a) == list(rl.UPDATE_STATS)
        for key in rl.UPDATE_STATS:
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), key
    torch.testing.assert_close(w_stepped, w_packed, rtol=1e-5, atol=1e-6)
    cpu = rl.PPOTrainer(rl.Policy(encoder="torch", seed=0), num_envs=2, steps=2)
    with pytest.raises(ValueError, match="CUDA"):
        rl.GraphedUpdate(cpu)
    with pytest.raises(ValueError, match="eager update"):
        rl.GraphedUpdate(cpu, warmup=0)
