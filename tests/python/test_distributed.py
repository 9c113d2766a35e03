"""CPU tier: kfuse.DistributedDataParallel over two processes (gloo on the CPU; NCCL runs the same calls on GPUs)
against torch's DistributedDataParallel on the same models and inputs: rank 0's parameters on every rank after
construction, and after each backward the same averaged gradients (the same sums of the same halves, so equal up
to float32 rounding order) on both wrappers and both ranks: with the gradients set to None before the backward (kfuse
reduces one flat tensor) and accumulated into (a packed copy), under no_sync() (no reduction, then the accumulated
sum reduced by the next synced backward), for a model with layers around the encoder and for the encoder alone
(where DDP keeps one of its parameters). On CPU the encoder runs the reference; the GPU tier runs the CUDA path."""

import pytest
import torch
import torch.distributed as dist

import kfuse
from kfuse.bench_rl import quiesce_process_group, spawn_with_deadline

WORLD = 2


def _model(kind: str, seed: int, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(seed)
    enc = kfuse.ResNetEncoder(3, layers=(1, 1, 1, 1))
    model = enc if kind == "encoder" else torch.nn.Sequential(enc, torch.nn.Flatten(), torch.nn.Linear(512 * 4, 5))
    return model.to(device, torch.float16) if device.type == "cuda" else model


def _grads(model) -> list:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _run(wrapper, kind: str, rank: int, device: torch.device) -> dict:
    model = _model(kind, seed=11 + rank, device=device)  # each rank starts elsewhere: the wrapper broadcasts rank 0's
    ddp = wrapper(model, device_ids=[device.index] if device.type == "cuda" else None)
    start = [p.detach().clone() for p in model.parameters()]
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    batches = [torch.rand(2, 3, 64, 64, generator=gen).to(device, next(model.parameters()).dtype) for _ in range(4)]
    out = {"start": start}

    def loss(x):
        y = ddp(x)
        return (y.float() * torch.linspace(-1, 1, y.numel(), device=y.device).view_as(y)).sum()

    model.zero_grad(set_to_none=True)
    loss(batches[0]).backward()
    out["fresh"] = _grads(model)  # .grad was None: kfuse's gradients lie in one buffer
    loss(batches[1]).backward()
    out["accumulated"] = _grads(model)  # accumulated into the previous ones
    model.zero_grad(set_to_none=True)
    with ddp.no_sync():
        loss(batches[2]).backward()
    out["no_sync"] = _grads(model)  # local only
    loss(batches[3]).backward()
    out["after_no_sync"] = _grads(model)  # local sum of two, then averaged
    return out


def _worker(rank: int, store: str, path: str, device_type: str = "cpu") -> None:
    cuda = device_type == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        from kfuse.bench_rl import nvlink_multicast_off

        nvlink_multicast_off()
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            device_id=device if cuda else None)
    try:
        results = {}
        for kind in ("with_head", "encoder"):
            results[kind, "torch"] = _run(torch.nn.parallel.DistributedDataParallel, kind, rank, device)
            results[kind, "kfuse"] = _run(kfuse.DistributedDataParallel, kind, rank, device)
        results = {k: {s: [None if g is None else g.cpu() for g in v] for s, v in r.items()} for k, r in results.items()}
        torch.save(results, f"{path}.{rank}")
        quiesce_process_group()
    finally:
        dist.destroy_process_group()


def run_workers(tmp, device_type: str = "cpu") -> list:
    spawn_with_deadline(_worker, (str(tmp / "store"), str(tmp / "out"), device_type), WORLD, timeout_s=300)
    return [torch.load(f"{tmp / 'out'}.{rank}") for rank in range(WORLD)]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_workers(tmp_path_factory.mktemp("ddp"))


def _edge_step(scenario: str, rank: int) -> list:
    """One step of a pattern that must still leave every rank with the same gradients (each rank its own data)."""
    model = _model("with_head", seed=21, device=torch.device("cpu"))
    enc = model[0]
    if scenario == "tied":  # one parameter in two places of the encoder
        enc.layers[1][0].fixup_scale = enc.layers[0][0].fixup_scale
    ddp = kfuse.DistributedDataParallel(model)
    if scenario == "frozen_later":  # fine-tuning: a parameter frozen after the wrapper was made
        enc.layers[0][0].conv1.weight.requires_grad_(False)
    gen = torch.Generator().manual_seed(200 + rank)
    x, x_next = (torch.rand(2, 3, 64, 64, generator=gen) for _ in range(2))
    model.zero_grad(set_to_none=True)
    y = ddp(x)
    if scenario == "no_grad_forward_between":  # a bootstrap value before the backward
        with torch.no_grad():
            ddp(x_next)
    y.square().mean().backward()
    if scenario == "second_backward_on_part":  # a penalty on some encoder parameters, its own backward
        (enc.layers[3][0].fixup_bias2b * rank + enc.stem[1].weight.sum() * (1 + rank)).sum().backward()
    return _grads(model)


EDGE_SCENARIOS = ("no_grad_forward_between", "tied", "frozen_later", "second_backward_on_part")


def _edge_worker(rank: int, store: str, path: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        torch.save({s: _edge_step(s, rank) for s in EDGE_SCENARIOS}, f"{path}.{rank}")
        quiesce_process_group()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def edge_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp_edge")
    spawn_with_deadline(_edge_worker, (str(tmp / "store"), str(tmp / "out")), WORLD, timeout_s=300)
    return [torch.load(f"{tmp / 'out'}.{rank}") for rank in range(WORLD)]


@pytest.mark.parametrize("scenario", EDGE_SCENARIOS)
def test_ranks_agree_in_the_patterns_users_write(edge_results, scenario):
    """A no-grad forward between a forward and its backward, a tied parameter, a parameter frozen after wrapping, a
    second backward over part of the encoder: every rank must end with the same (averaged) gradients."""
    a, b = edge_results[0][scenario], edge_results[1][scenario]
    assert_same_gradients(a, b, scenario)
    assert any(g is not None for g in a)


def test_find_unused_parameters_is_refused(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="find_unused_parameters"):
            kfuse.DistributedDataParallel(_model("with_head", seed=1, device=torch.device("cpu")),
                                          find_unused_parameters=True)
    finally:
        dist.destroy_process_group()


def assert_same_gradients(a: list, b: list, what: str, tol: float = 1e-6) -> None:
    """Normwise per parameter: float32 sums in another order differ by ~1e-7 relative; a missing or doubled
    reduction by O(1)."""
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert (x is None) == (y is None), f"{what}: parameter {i}"
        if x is not None:
            err = ((x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-30)).item()
            assert err <= tol, f"{what}: parameter {i} differs by {err:.2e}"


_assert_close = assert_same_gradients


@pytest.mark.parametrize("kind", ["with_head", "encoder"])
@pytest.mark.parametrize("stage", ["start", "fresh", "accumulated", "after_no_sync"])
def test_same_as_torch_ddp_on_every_rank(results, kind, stage):
    reference = results[0][kind, "torch"][stage]
    for rank in range(WORLD):
        _assert_close(results[rank][kind, "kfuse"][stage], reference, f"rank {rank} {stage}")
        _assert_close(results[rank][kind, "torch"][stage], reference, f"torch DDP rank {rank} {stage}")


@pytest.mark.parametrize("kind", ["with_head", "encoder"])
def test_no_sync_keeps_local_gradients(results, kind):
    for rank in range(WORLD):
        _assert_close(results[rank][kind, "kfuse"]["no_sync"], results[rank][kind, "torch"]["no_sync"],
                      f"rank {rank}")
    differ = [not torch.equal(a, b) for a, b in zip(results[0][kind, "kfuse"]["no_sync"],
                                                    results[1][kind, "kfuse"]["no_sync"]) if a is not None]
    assert any(differ), "no_sync() gradients are local: the ranks' data differ, so must they"



def test_one_buffer_view_only_where_the_gradients_lie_back_to_back():
    """The fast path reduces the buffer in place: it must cover exactly the gradients, in order, and nothing else."""
    from kfuse.distributed import _one_buffer_view

    flat = torch.arange(10.0)
    a, b, c = flat[0:4].view(2, 2), flat[4:7], flat[7:10]
    view = _one_buffer_view([a, b, c])
    assert view is not None and view.data_ptr() == flat.data_ptr() and view.numel() == 10
    view.add_(1)
    assert torch.equal(flat, torch.arange(10.0) + 1)
    assert _one_buffer_view([flat[4:7], flat[0:4]]) is None  # out of order
    assert _one_buffer_view([flat[0:4], flat[5:8]]) is None  # a gap
    assert _one_buffer_view([flat[0:4], torch.zeros(3)]) is None  # another storage
    assert _one_buffer_view([flat[0:4], flat[4:10].half()]) is None  # another dtype
    assert _one_buffer_view([flat[0:8].view(2, 4).t()]) is None  # not contiguous


def test_the_model_is_left_as_it_was_for_a_later_plain_ddp(tmp_path):
    """The parameters kfuse reduces are hidden from DDP only inside the wrapper's construction: left on the module,
    a plain DistributedDataParallel made later would never average them (one process group of one here)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = _model("with_head", seed=1, device=torch.device("cpu"))
        kfuse.DistributedDataParallel(model)
        assert not hasattr(model, "_ddp_params_and_buffers_to_ignore")
        model._ddp_params_and_buffers_to_ignore = ["2.bias"]
        kfuse.DistributedDataParallel(model)
        assert model._ddp_params_and_buffers_to_ignore == ["2.bias"]
    finally:
        dist.destroy_process_group()
