"""The workload kfuse's encoder is trained in: a DD-PPO-shaped policy, its rollout storage, GAE and the PPO update with
fp32 master weights that are copied back into the fp16 parameters through `.data.copy_`, as batch-simulation RL
programs do (bps-nav's shape; shared/spec/ddppo-loop.md). The observations are synthetic (random uint8 RGBA frames,
goals, rewards and episode ends), deterministic under a seed. The encoder is kfuse's or plain PyTorch's; nothing else
differs between the two.

    policy = Policy(encoder="kfuse").to(device, torch.float16)
    trainer = PPOTrainer(policy, num_envs=128, steps=32)
    stats = trainer.iteration()   # 32 rollout steps, then the update (1 epoch, 2 minibatches)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from . import reference
from .distributed import DistributedDataParallel
from .encoder import ResNetEncoder

__all__ = ["Policy", "SyntheticEnvs", "RolloutStorage", "PPOTrainer", "PPOConfig", "compute_gae", "masked_lstm", "Actor",
           "GraphedActor", "GraphedUpdate", "ppo_terms", "UPDATE_STATS"]

NUM_ACTIONS = 4
HIDDEN = 512
UPDATE_STATS = ("loss", "surrogate", "value_loss", "entropy")


class ObservationNorm(nn.Module):
    """Running per-channel mean and variance of the RGB frames in [0, 1] (fp32 buffers), updated from each training
    batch; frames are normalized as (x - mean) * rsqrt(max(var, 1e-2))."""

    def __init__(self, channels: int = 3):
        super().__init__()
        self.register_buffer("mean", torch.zeros(channels))
        self.register_buffer("var", torch.ones(channels))
        self.register_buffer("count", torch.tensor(1e-4))
        self.version = 0  # bumped by every update (consumers re-read the statistics)

    def _apply(self, fn, recurse=True):
        # Device moves apply; dtype casts (policy.half()) do not: the statistics stay fp32.
        return super()._apply(lambda t: fn(t).float() if t.is_floating_point() else fn(t), recurse)

    @torch.no_grad()
    def update(self, frames: torch.Tensor) -> None:
        x = frames[..., : self.mean.numel()].float().div_(255).reshape(-1, self.mean.numel())
        n = x.shape[0]
        mean, var = x.mean(0), x.var(0, unbiased=False)
        total = self.count + n
        delta = mean - self.mean
        self.var.copy_((self.var * self.count + var * n + delta.square() * self.count * n / total) / total)
        self.mean.add_(delta * n / total)
        self.count.copy_(total)
        self.version += 1


class Policy(nn.Module):
    """Encoder (SE-ResNet9-FixUp, kfuse's or plain PyTorch's), compression conv, fc + LayerNorm, goal and previous-
    action embeddings, a 2-layer LSTM with masked resets, actor and critic heads (ddppo-loop.md, "The policy")."""

    def __init__(self, encoder: str = "kfuse", in_channels: int = 3, seed: int = 0):
        super().__init__()
        if encoder not in ("kfuse", "torch"):
            raise ValueError(f"encoder must be 'kfuse' or 'torch', got {encoder!r}")
        torch.manual_seed(seed)
        self.kind = encoder
        self.obs_norm = ObservationNorm(in_channels)
        # Both encoders start from the same weights: the plain one's init, loaded into kfuse's.
        enc = reference.ResNetEncoder(in_channels)
        self.encoder = ResNetEncoder.from_torch(enc) if encoder == "kfuse" else enc
        torch.manual_seed(seed + 1)  # the other layers alike for both (from_torch draws numbers of its own)
        self.compress = nn.Sequential(nn.Conv2d(512, 256, 3, padding=1), nn.ReLU())
        self.fc = nn.Sequential(nn.Flatten(), nn.Linear(1024, 512, bias=False), nn.LayerNorm(512), nn.ReLU())
        self.goal = nn.Linear(3, 32)
        self.prev_action = nn.Embedding(NUM_ACTIONS + 1, 32)
        self.rnn = nn.LSTM(512 + 64, HIDDEN, num_layers=2)
        self.actor = nn.Linear(HIDDEN, NUM_ACTIONS)
        self.critic = nn.Linear(HIDDEN, 1)
        # Several steps' LSTM as one call per step instead of over packed episode pieces (masked_lstm): no host work
        # on the masks, what a CUDA graph of the update needs (GraphedUpdate sets it).
        self.stepped_lstm = False

    def _frames(self, frames: torch.Tensor) -> torch.Tensor:
        """uint8 RGBA (N, H, W, 4) -> the encoder's output, normalized by the running statistics."""
        mean, var = self.obs_norm.mean, self.obs_norm.var
        if self.kind == "kfuse" and not torch.compiler.is_compiling():
            # (Under torch.compile the statistics stay device tensors of the graph, normalized by the ops below: a
            # fold set from host copies would put them in the graph as constants, recompiled at every update.)
            self.sync_input_normalization()
            return self.encoder(frames)
        dtype = next(self.encoder.parameters()).dtype
        x = frames[..., : mean.numel()].permute(0, 3, 1, 2).to(dtype) / 255
        x = (x - mean.view(1, -1, 1, 1).to(dtype)) * torch.rsqrt(var.clamp_min(1e-2)).view(1, -1, 1, 1).to(dtype)
        return self.encoder(x)

    def sync_input_normalization(self) -> None:
        """kfuse's encoder: the running statistics folded into the stem's read of uint8 frames (exact), set again
        after each update of the statistics. The stem reads the fold from device memory, so a CUDA graph captured
        around the policy sees every later fold; noticing the update is host work that a replay does not repeat (and
        that must not run during a capture), so a graph's owner calls this before each replay (GraphedActor)."""
        if self.kind == "kfuse" and getattr(self, "_norm_version", None) != self.obs_norm.version:
            self.encoder.set_input_normalization(self.obs_norm.mean.detach().cpu(), self.obs_norm.var.detach().cpu())
            self._norm_version = self.obs_norm.version

    def forward(self, frames, goal, prev_action, hidden, masks, final_state: bool = True):
        """frames (T*N, H, W, 4) uint8, goal (T*N, 3), prev_action (T*N,) long, masks (T*N,) 0 at episode starts,
        hidden (h, c) each (2, N, HIDDEN) at the first step. Returns fp32 logits (T*N, 4), values (T*N,) and the
        hidden state after the last step (None with final_state=False, which lets several steps run as one padded
        LSTM call instead of a packed one)."""
        n = hidden[0].shape[1]
        f = self.fc(self.compress(self._frames(frames)))
        dtype = f.dtype
        z = torch.cat([f, self.goal(goal.to(dtype)), self.prev_action(prev_action)], 1)
        o, hidden = masked_lstm(self.rnn, z, hidden, masks, n, final_state, stepped=self.stepped_lstm)
        return self.actor(o).float(), self.critic(o).float().squeeze(1), hidden

    def initial_hidden(self, n: int, device=None, dtype=None):
        p = self.actor.weight
        z = torch.zeros(2, n, HIDDEN, device=device or p.device, dtype=dtype or p.dtype)
        return z, z.clone()


def masked_lstm(rnn: nn.LSTM, z: torch.Tensor, hidden, masks: torch.Tensor, n: int, final_state: bool = True,
                stepped: bool = False):
    """The LSTM over T steps of n environments (z: (T*n, F), time-major) whose state is reset where masks is 0.
    One step (the rollout's): the state times the mask, then the LSTM. Several (the update's): in one call, each
    episode piece (an environment's steps from a reset, or from the rollout's start, to the next reset) its own
    sequence of a PackedSequence, starting from the stored state (first pieces, times the mask) or from zeros: equal
    to stepping the LSTM T times, one cuDNN call instead of T, forward and backward. Returns the outputs (T*n, H)
    and the state after the last step; with final_state=False (several steps) the state is None and the pieces run
    padded to the longest instead of packed: a piece's padding steps come after its outputs, so the outputs and
    every gradient are the same, and the call avoids cuDNN's variable-length path. stepped: several steps as one
    call per step (the definition itself), with no host work on the masks (what a CUDA graph can hold)."""
    h0, c0 = hidden
    if stepped and z.shape[0] > n:
        outs, state = [], hidden
        for t in range(z.shape[0] // n):
            o, state = masked_lstm(rnn, z[t * n:(t + 1) * n], state, masks[t * n:(t + 1) * n], n)
            outs.append(o)
        return torch.cat(outs, 0), (state if final_state else None)
    if z.shape[0] == n:
        m = masks.to(z.dtype).view(1, n, 1)
        o, (h, c) = rnn(z.unsqueeze(0), (h0 * m, c0 * m))
        # (Dynamo's traced LSTM, allow_rnn, returned the states as (layers, 1, n, H): the same values, one more dim.)
        return o.squeeze(0), (h.reshape(h0.shape), c.reshape(c0.shape))
    return _packed_lstm(rnn, z, hidden, masks, n, final_state)


@torch.compiler.disable  # host index math on the masks, and a PackedSequence: eager
def _packed_lstm(rnn: nn.LSTM, z: torch.Tensor, hidden, masks: torch.Tensor, n: int, final_state: bool = True):
    h0, c0 = hidden
    steps = z.shape[0] // n
    seq = episode_pieces(masks.detach().view(steps, n).cpu())
    lengths = seq.pop("lengths")
    dev = _to_device(seq, z.device)  # one host-to-device copy for every index
    padded = z.index_select(0, dev["gather"].view(-1)).view(*dev["gather"].shape, z.shape[1])  # (L, S, F)
    # (index_select, not z[gather]: its backward adds rows atomically where advanced indexing's sorts them; the only
    # repeated row is the padding's, whose gradient is zero, so the sums are exact in any order.)
    env = dev["env"]
    keep = (masks.view(steps, n)[0].to(z.dtype)[env] * dev["first"].to(z.dtype)).view(1, -1, 1)
    start = (h0[:, env] * keep, c0[:, env] * keep)
    if not final_state:
        out, _ = rnn(padded, start)  # (L, S, H); past a piece's end, steps nothing reads
    else:
        packed = nn.utils.rnn.pack_padded_sequence(padded, lengths, enforce_sorted=False)
        out, (h, c) = rnn(packed, start)
        out, _ = nn.utils.rnn.pad_packed_sequence(out, total_length=padded.shape[0])
    o = out.reshape(-1, out.shape[2]).index_select(0, dev["row"] * out.shape[1] + dev["col"])  # time-major (T*n, H)
    if not final_state:
        return o, None
    last = dev["last"]
    return o, (h[:, last], c[:, last])


def _to_device(seq: dict, device) -> dict:
    """The index tensors of `seq` (long or bool, on the CPU) on `device`, copied in one transfer."""
    flat = torch.cat([v.reshape(-1).long() for v in seq.values()])
    flat = flat.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else flat.to(device)
    out, at = {}, 0
    for k, v in seq.items():
        piece = flat[at:at + v.numel()].view(v.shape)
        out[k] = piece.bool() if v.dtype == torch.bool else piece
        at += v.numel()
    return out


def episode_pieces(masks: torch.Tensor) -> dict:
    """The pieces of masked_lstm from masks (T, n) on the CPU: for each piece its environment, whether it starts the
    rollout (`first`) and its length; `gather` (L, S) the time-major row of each piece's steps (0 past its end);
    `row`, `col` where each time-major row sits in the padded output; `last` each environment's last piece."""
    steps, n = masks.shape
    starts = masks == 0
    starts[0] = True
    env_major = starts.t().reshape(-1)  # (n*T): piece starts, environment by environment
    piece = env_major.long().cumsum(0) - 1  # the piece of each (environment, step)
    count = int(piece[-1]) + 1
    t = torch.arange(steps).repeat(n)
    i = torch.arange(n).repeat_interleave(steps)
    start_t = torch.zeros(count, dtype=torch.long).scatter_(0, piece[env_major], t[env_major])
    k = t - start_t[piece]  # position inside the piece
    lengths = torch.bincount(piece, minlength=count)
    gather = torch.zeros(steps, count, dtype=torch.long)
    gather[k, piece] = t * n + i
    row = torch.empty(steps * n, dtype=torch.long)
    col = torch.empty(steps * n, dtype=torch.long)
    row[t * n + i], col[t * n + i] = k, piece
    env = torch.zeros(count, dtype=torch.long).scatter_(0, piece, i)
    last = torch.zeros(n, dtype=torch.long).scatter_reduce_(0, i, piece, "amax", include_self=False)
    return {"gather": gather[: int(lengths.max())], "lengths": lengths, "env": env, "first": start_t == 0,
            "row": row, "col": col, "last": last}


class Actor(nn.Module):
    """One rollout step: the policy on the new observations, then an action drawn from its logits by inverting the
    cumulative distribution at `u` (uniform numbers in [0, 1), drawn by the caller from the rollout's generator, so
    that the step holds no generator and compiles and captures whole). Returns the action, its log-probability, the
    value, the new recurrent state and the next step's previous action (NUM_ACTIONS where the episode ended)."""

    def __init__(self, policy: Policy):
        super().__init__()
        self.policy = policy

    def forward(self, frames, goal, prev_action, hidden, mask, u):
        logits, value, hidden = self.policy(frames, goal, prev_action, hidden, mask)
        logp = logits.log_softmax(-1)
        cdf = logp.exp().cumsum(-1)
        action = (cdf < u.unsqueeze(1) * cdf[:, -1:]).sum(-1).clamp_max(logits.shape[1] - 1)
        logprob = logp.gather(1, action.unsqueeze(1)).squeeze(1)
        return action, logprob, value, hidden


def _eager_on_side_stream(fn):
    """fn() on a fresh side stream that waits for the caller's, which then waits for it: the eager calls before a
    CUDA graph capture (where cuDNN and cuBLAS set up their workspaces off the capture's stream). Tensors of the
    result, made there, are recorded on the caller's stream, which uses them."""
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        out = fn()
    main.wait_stream(side)
    for t in torch.utils._pytree.tree_leaves(out):
        if isinstance(t, torch.Tensor):
            t.record_stream(main)
    return out


class GraphedActor:
    """An Actor whose rollout step runs as one CUDA graph (what torch.compile's reduce-overhead mode does, without the
    compiler): a step of ~60 small kernels costs the host one replay instead of ~60 launches, and the batch-128 step
    is bound by its launches, not by the GPU. Called like the Actor: `warmup` eager calls (on a side stream, as CUDA
    graph capture wants: cuDNN and cuBLAS set up their workspaces there), then the capture on the next call's input
    shapes; each later call with those shapes copies its inputs into the graph's buffers, replays, and returns copies
    of the outputs (the next replay rewrites the graph's). Other shapes, and the policy in the other mode (train /
    eval) than at the capture, run eagerly. Without gradients only (the rollout's torch.no_grad()).

    What the graph reads at replay: the parameters' storage (writes through `.data.copy_`, in-place optimizers and
    `load_state_dict` are seen; kfuse's encoder checks its parameters on the device at every replay) and the inputs'
    copies. Replacing a parameter tensor (`module.weight = ...`, `.to()` to another device) leaves the graph reading
    the old storage: call `reset()` after such a change. The observation statistics' fold into kfuse's stem is
    host work, done before every call (Policy.sync_input_normalization)."""

    def __init__(self, actor: Actor, warmup: int = 3):
        if warmup < 1:
            raise ValueError(f"GraphedActor needs at least one eager warm-up call before the capture, got {warmup}")
        self.actor, self.warmup = actor, warmup
        self.reset()

    def reset(self) -> None:
        """Drops the graph: the next calls warm up and capture again (after parameters were replaced)."""
        self.graph, self.static_in, self.static_out, self.key, self.calls = None, None, None, None, 0

    @staticmethod
    def _flat(args) -> list:
        frames, goal, prev_action, (h, c), mask, u = args
        return [frames, goal, prev_action, h, c, mask, u]

    def __call__(self, frames, goal, prev_action, hidden, mask, u):
        if torch.is_grad_enabled():
            raise RuntimeError("GraphedActor replays the rollout step without gradients: call it under torch.no_grad()")
        args = (frames, goal, prev_action, hidden, mask, u)
        self.actor.policy.sync_input_normalization()
        flat = self._flat(args)
        key = [(t.shape, t.dtype, t.device) for t in flat] + [self.actor.policy.training]
        if self.graph is None and self.calls >= self.warmup:
            self._capture(flat, key)
        if self.graph is None or key != self.key:
            self.calls += 1
            return _eager_on_side_stream(lambda: self.actor(*args))
        for buf, t in zip(self.static_in, flat):
            buf.copy_(t)
        self.graph.replay()
        action, logprob, value, (h, c) = self.static_out
        return action.clone(), logprob.clone(), value.clone(), (h.clone(), c.clone())

    def _capture(self, flat, key) -> None:
        static_in = [t.clone() for t in flat]
        frames, goal, prev_action, h, c, mask, u = static_in
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self.actor(frames, goal, prev_action, (h, c), mask, u)
        self.graph, self.static_in, self.static_out, self.key = graph, static_in, out, key


class GraphedUpdate:
    """A PPOTrainer's update replayed as one CUDA graph: both minibatches' forward and backward, the gradients'
    unscaling and clipping, the fused Adam step on the fp32 masters and their copy back into the parameters, with no
    host work in between (~700 launches of an update bound by the host become one replay). The update reads the
    rollout storage, which the rollout fills in place, and runs the LSTM stepped (Policy.stepped_lstm: no host work
    on the masks). `warmup` eager updates first (on a side stream, where the libraries set up their workspaces), then
    the capture; each later call replays and returns the loss terms (one host synchronization, as update() has).
    Installs itself as `trainer.update`; folds the observation statistics into kfuse's stem before each call, as the
    policy's forward would (a replay runs no Python). Single process only: DistributedDataParallel's hooks are not
    captured. The optimizer runs with capturable=True (its step count on the device); its learning rate is the one
    at the capture."""

    def __init__(self, trainer: "PPOTrainer", warmup: int = 2):
        if warmup < 1:
            raise ValueError(f"GraphedUpdate needs at least one eager update before the capture, got {warmup}")
        if trainer.device.type != "cuda":
            raise ValueError(f"GraphedUpdate needs a trainer on a CUDA device, got {trainer.device}")
        if trainer.ddp is not None:
            raise ValueError("GraphedUpdate cannot capture DistributedDataParallel's all-reduce hooks: run the update "
                             "eagerly with several processes")
        if not all(group.get("fused") for group in trainer.optimizer.param_groups):
            raise ValueError("GraphedUpdate needs the trainer's fused Adam (its step counts live on the device)")
        self.trainer, self.warmup = trainer, warmup
        trainer.policy.stepped_lstm = True
        for group in trainer.optimizer.param_groups:
            group["capturable"] = True
        self.graph, self.stats, self.calls = None, None, 0
        trainer.update = self

    def __call__(self) -> dict:
        # The rollout ends by updating the observation statistics: fold them into kfuse's stem before a replay reads
        # it (host work; the eager update does it in the policy's forward).
        self.trainer.policy.sync_input_normalization()
        self.trainer.policy.train()  # (host state the update sets, which a replay does not)
        if self.graph is None and self.calls >= self.warmup:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.stats = self.trainer.update_tensors()
            self.graph = graph
        if self.graph is None:
            self.calls += 1
            return dict(zip(UPDATE_STATS, _eager_on_side_stream(self.trainer.update_tensors).tolist()))
        self.graph.replay()
        return dict(zip(UPDATE_STATS, self.stats.tolist()))


def ppo_terms(logits, actions, old_logprobs):
    """The ratio of new to old action probabilities and the entropy of the new distribution, per sample."""
    logp = logits.log_softmax(-1)
    ratio = torch.exp(logp.gather(1, actions.unsqueeze(1)).squeeze(1) - old_logprobs)
    entropy = -(logp.exp() * logp).sum(-1)
    return ratio, entropy


class SyntheticEnvs:
    """N environments that return random uint8 RGBA frames, goals and rewards, and end episodes at random (1 in 50
    steps), from a seeded generator on the policy's device."""

    def __init__(self, num_envs: int, device, seed: int = 0, size: int = 64, end_probability: float = 0.02):
        self.n, self.device, self.size, self.p_end = num_envs, torch.device(device), size, end_probability
        self.gen = torch.Generator(device=self.device).manual_seed(seed)

    def observe(self):
        frames = torch.randint(0, 256, (self.n, self.size, self.size, 4), generator=self.gen, device=self.device,
                               dtype=torch.uint8)
        goal = torch.rand(self.n, 3, generator=self.gen, device=self.device) * 2 - 1
        return frames, goal

    def step(self, actions: torch.Tensor):
        """Rewards and masks (0 where the episode ended) after `actions`."""
        reward = torch.randn(self.n, generator=self.gen, device=self.device) * 0.1 + 0.01 * (actions == 0).float()
        done = torch.rand(self.n, generator=self.gen, device=self.device) < self.p_end
        return reward, (~done).float()


@dataclass
class PPOConfig:
    clip: float = 0.2
    value_coef: float = 0.5
    entropy_coef: float = 0.01
    gamma: float = 0.99
    tau: float = 0.95
    lr: float = 5e-4
    eps: float = 1e-5
    max_grad_norm: float = 1.0
    minibatches: int = 2
    epochs: int = 1


class RolloutStorage:
    """One rollout of `steps` steps of `n` environments, with the recurrent state at its start."""

    def __init__(self, steps: int, n: int, device, size: int = 64, dtype=torch.float16):
        self.steps, self.n = steps, n
        self.frames = torch.zeros(steps, n, size, size, 4, dtype=torch.uint8, device=device)
        self.goals = torch.zeros(steps, n, 3, device=device)
        self.prev_actions = torch.zeros(steps, n, dtype=torch.long, device=device)
        self.masks = torch.ones(steps + 1, n, device=device)
        self.actions = torch.zeros(steps, n, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(steps, n, device=device)
        self.values = torch.zeros(steps + 1, n, device=device)
        self.rewards = torch.zeros(steps, n, device=device)
        self.hidden0 = (torch.zeros(2, n, HIDDEN, device=device, dtype=dtype),
                        torch.zeros(2, n, HIDDEN, device=device, dtype=dtype))


def compute_gae(rewards, values, masks, gamma: float, tau: float) -> torch.Tensor:
    """Returns by generalized advantage estimation: rewards (T, N), values (T+1, N), masks (T+1, N), masks[t+1] = 0
    where the episode ended at step t. The recurrence gae_t = delta_t + gamma tau masks[t+1] gae_{t+1} unrolled:
    gae_t = sum over u >= t of delta_u times the product of gamma tau masks[v] for t < v <= u, all T at once (a
    T x T x N product table; a handful of launches instead of a dozen per step)."""
    steps = rewards.shape[0]
    delta = rewards + gamma * values[1:] * masks[1:] - values[:-1]
    upper = torch.ones(steps, steps, device=rewards.device, dtype=torch.bool).triu()  # upper[t, u]: u >= t
    later = upper.triu(1).unsqueeze(-1)  # u > t
    table = torch.where(later, (gamma * tau * masks[:steps]).unsqueeze(0), 1.0)  # gamma tau masks[u] where u > t
    weight = table.cumprod(1) * upper.unsqueeze(-1)
    return (weight * delta.unsqueeze(0)).sum(1) + values[:-1]


class PPOTrainer:
    """Rollouts and PPO updates of `policy` on synthetic environments. The optimizer steps fp32 master weights (Adam,
    lr scaled by the batch as in bps-nav) and copies them back into the policy's parameters with `p.data.copy_` (no
    version bump: the write kfuse must follow); fp16 policies use a GradScaler.

    `act` and `evaluate` are what the rollout and the update call (default: `Actor(policy)`, one rollout step; the
    policy itself, or its DistributedDataParallel wrapper where a process group is up), e.g. differently compiled
    versions of them; they must compute with the policy's parameters."""

    def __init__(self, policy: Policy, num_envs: int = 128, steps: int = 32, config: PPOConfig | None = None,
                 seed: int = 0, distributed: bool | None = None):
        self.policy, self.n, self.steps = policy, num_envs, steps
        self.cfg = config or PPOConfig()
        p = next(policy.parameters())
        self.device, self.dtype = p.device, p.dtype
        # Data parallel where a process group is up (one process per GPU, as DD-PPO runs): the update runs through
        # DistributedDataParallel, whose construction broadcasts rank 0's parameters into every rank's storage and
        # whose backward all-reduces the gradients; each rank simulates its own environments.
        if distributed is None:
            distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.rank = torch.distributed.get_rank() if distributed else 0
        self.ddp = None
        if distributed:
            ids = [self.device.index] if self.device.type == "cuda" else None
            # (gradient_as_bucket_view: the gradients are views of DDP's buckets, read in place by the all-reduce,
            # instead of a copy of each into its bucket and another back after it; kfuse's wrapper averages a kfuse
            # encoder's gradients in one all-reduce of their buffer instead, and is DDP for everything else)
            self.ddp = DistributedDataParallel(policy, device_ids=ids, gradient_as_bucket_view=True)
        self.envs = SyntheticEnvs(num_envs, self.device, seed + 1000 * self.rank)
        self.sample_gen = torch.Generator(device=self.device).manual_seed(seed + 1 + 1000 * self.rank)
        self.params = [q for q in policy.parameters() if q.requires_grad]
        self.masters = [q.detach().float().clone().requires_grad_() for q in self.params]
        self.master_grads = [torch.empty_like(m) for m in self.masters]
        lr = self.cfg.lr * math.sqrt(num_envs * steps / 4096)  # scaled by the batch
        # (fused: one multi-tensor kernel for the whole step, as users of large fp32 masters configure it)
        self.optimizer = torch.optim.Adam(self.masters, lr=lr, eps=self.cfg.eps, fused=self.device.type == "cuda")
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.dtype == torch.float16)
        self.storage = RolloutStorage(steps, num_envs, self.device, dtype=self.dtype)
        self.hidden = policy.initial_hidden(num_envs)
        self.prev_action = torch.full((num_envs,), NUM_ACTIONS, dtype=torch.long, device=self.device)
        self.frames, self.goal = self.envs.observe()
        self.act = Actor(policy)
        self.evaluate = self.ddp if self.ddp is not None else policy

    @torch.no_grad()
    def rollout(self) -> None:
        s, pol = self.storage, self.policy
        pol.eval()
        s.hidden0[0].copy_(self.hidden[0])  # in place: a graph of the update reads these buffers
        s.hidden0[1].copy_(self.hidden[1])
        s.masks[0] = s.masks[-1]
        for t in range(self.steps):
            s.frames[t], s.goals[t], s.prev_actions[t] = self.frames, self.goal, self.prev_action
            u = torch.rand(self.n, generator=self.sample_gen, device=self.device)
            action, logprob, value, self.hidden = self.act(self.frames, self.goal, self.prev_action, self.hidden,
                                                           s.masks[t], u)
            s.actions[t], s.logprobs[t], s.values[t] = action, logprob, value
            reward, mask = self.envs.step(action)
            s.rewards[t], s.masks[t + 1] = reward, mask
            self.prev_action = action.masked_fill(mask == 0, NUM_ACTIONS)
            self.frames, self.goal = self.envs.observe()
        u = torch.zeros(self.n, device=self.device)
        s.values[-1] = self.act(self.frames, self.goal, self.prev_action, self.hidden, s.masks[-1], u)[2]
        pol.obs_norm.update(s.frames)

    def update(self) -> dict:
        """One PPO update over the rollout in storage; its mean loss terms."""
        return dict(zip(UPDATE_STATS, self.update_tensors().tolist()))

    def update_tensors(self) -> torch.Tensor:
        """update() without its host synchronization: the mean loss terms as one device tensor (UPDATE_STATS)."""
        s, cfg, pol = self.storage, self.cfg, self.policy
        returns = compute_gae(s.rewards, s.values, s.masks, cfg.gamma, cfg.tau)
        adv = returns - s.values[:-1]
        adv = (adv - adv.mean()) / (adv.std() + 1e-5)
        pol.train()
        stats = []
        envs = torch.arange(self.n, device=self.device)
        for _ in range(cfg.epochs):
            for mb in envs.chunk(cfg.minibatches):
                m = len(mb)
                flat = lambda v: v[:, mb].reshape(self.steps * m, *v.shape[2:])  # noqa: E731 (time-major)
                hidden = (s.hidden0[0][:, mb], s.hidden0[1][:, mb])
                logits, values, _ = self.evaluate(flat(s.frames), flat(s.goals), flat(s.prev_actions), hidden,
                                                  flat(s.masks[:-1]), final_state=False)
                ratio, entropy = ppo_terms(logits, flat(s.actions), flat(s.logprobs))
                a = flat(adv)
                surrogate = torch.min(ratio * a, ratio.clamp(1 - cfg.clip, 1 + cfg.clip) * a).mean()
                value_loss = 0.5 * (flat(returns) - values).square().mean()
                entropy = entropy.mean()
                loss = -surrogate + cfg.value_coef * value_loss - cfg.entropy_coef * entropy
                self._step(loss)
                stats.append(torch.stack([loss.detach(), surrogate.detach(), value_loss.detach(), entropy.detach()]))
        return torch.stack(stats).mean(0)

    def _step(self, loss: torch.Tensor) -> None:
        for p in self.params:
            p.grad = None
        self.scaler.scale(loss).backward()
        grads = [p.grad for p in self.params]
        if all(g is not None for g in grads):
            torch._foreach_copy_(self.master_grads, grads)  # fp16 -> fp32, multi-tensor launches
        else:
            for g, buf in zip(grads, self.master_grads):
                if g is not None:
                    buf.copy_(g)
        for m, g, buf in zip(self.masters, grads, self.master_grads):
            m.grad = None if g is None else buf
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.masters, self.cfg.max_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        with torch.no_grad():  # as bps-nav does, p.data.copy_(master) for each p: no version bump
            torch._foreach_copy_([p.data for p in self.params], self.masters)

    def iteration(self) -> dict:
        self.rollout()
        return self.update()
