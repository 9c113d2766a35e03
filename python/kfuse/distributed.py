"""Data parallel training with kfuse modules: ``kfuse.DistributedDataParallel``, torch's DistributedDataParallel with
the gradients of every ``kfuse.ResNetEncoder`` inside the model reduced by kfuse, as one flat tensor per encoder.

torch's DDP reduces gradients parameter by parameter: each one's autograd hook copies (or, with bucket views, scales)
it into its bucket, ~40 us of host time per parameter on an H100 machine, ~2 ms for the encoder's 62 parameters
(more than its whole backward on the device: the 2-GPU step became host-bound, 1.09-1.33x the 1-GPU step). kfuse's
backward hands all of an encoder's gradients to autograd at once, as views of one buffer; reduced here in one
all-reduce of that buffer at the end of the backward pass (or of a packed copy where the gradients do not lie in
one), the step pays the all-reduce once. Everything else is DDP's: the wrapper is a subclass, the other parameters are DDP's to reduce, and
``no_sync()`` holds for both (the decision is taken at the forward, as DDP's own).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from .encoder import ResNetEncoder, _param_list


class _EncoderGradientReducer:
    """Averages one encoder's gradients over the process group once per synced backward: the first of its
    parameters' post-accumulate hooks in a backward pass queues one all-reduce of all of them for the end of that
    pass (autograd's final callback, on the streams of the backward's caller: every gradient is complete there).
    Reducing again what is already averaged changes nothing, so a backward over part of the encoder (or a second
    backward through a retained graph) averages what it added and leaves the rest as it was."""

    def __init__(self, encoder: ResNetEncoder, ddp: "DistributedDataParallel", left_to_ddp: set[int]):
        self.params, seen = [], set(left_to_ddp)
        for p in _param_list(encoder, encoder.config):
            if id(p) not in seen:  # each parameter once (tied ones, and the one DDP keeps, excluded)
                seen.add(id(p))
                self.params.append(p)
        self.ddp = weakref.ref(ddp)
        self.task = None  # the backward pass whose reduction is queued
        self.hooked: set[int] = set()
        self.hook_trainable()

    def hook_trainable(self) -> None:
        """Hooks every parameter that requires a gradient now (a parameter unfrozen after construction included)."""
        for p in self.params:
            if p.requires_grad and id(p) not in self.hooked:
                p.register_post_accumulate_grad_hook(self._accumulated)
                self.hooked.add(id(p))

    def _accumulated(self, p: torch.Tensor) -> None:
        ddp = self.ddp()
        if ddp is None or not ddp._kfuse_sync:
            return
        task = torch._C._current_graph_task_id()
        if task == self.task:
            return
        self.task = task
        torch.autograd.Variable._execution_engine.queue_callback(self._reduce_at_end)

    def _reduce_at_end(self) -> None:
        self.task = None
        ddp = self.ddp()
        if ddp is not None:
            self.reduce(ddp.process_group)

    @torch.no_grad()
    def reduce(self, group) -> None:
        grads = [p.grad for p in self.params if p.requires_grad and p.grad is not None]
        if not grads:
            return
        world = dist.get_world_size(group)
        flat = _one_buffer_view(grads)
        if flat is not None:
            flat.div_(world)
            dist.all_reduce(flat, group=group)
            return
        flat = torch.cat([g.reshape(-1) for g in grads]).div_(world)
        dist.all_reduce(flat, group=group)
        torch._foreach_copy_(grads, [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in grads]), grads)])


def _one_buffer_view(grads: list[torch.Tensor]) -> torch.Tensor | None:
    """One flat tensor over all of `grads` where they lie back to back in one storage, in order, contiguous (kfuse's
    backward returns them so, and autograd keeps its tensors as .grad when .grad was None); else None."""
    first = grads[0]
    if any(g.dtype != first.dtype or g.device != first.device or not g.is_contiguous() or g.is_sparse
           for g in grads):
        return None
    storage, size = first.untyped_storage(), first.element_size()
    expected = first.data_ptr()
    for g in grads:
        if g.data_ptr() != expected or g.untyped_storage().data_ptr() != storage.data_ptr():
            return None
        expected += g.numel() * size
    total = sum(g.numel() for g in grads)
    return torch.empty(0, dtype=first.dtype, device=first.device).set_(storage, first.storage_offset(), (total,))


class DistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
    """``torch.nn.parallel.DistributedDataParallel`` for models that contain ``kfuse.ResNetEncoder`` modules: same
    arguments, same behaviour (rank 0's parameters broadcast at construction, averaged gradients after each synced
    backward, ``no_sync()``), but each encoder's gradients are averaged in one all-reduce after its backward instead
    of parameter by parameter through DDP's buckets (DDP ignores those parameters). Models without a kfuse encoder
    get plain DDP. As with DDP, the parameters must not be replaced after construction."""

    def __init__(self, module: torch.nn.Module, *args, **kwargs):
        if kwargs.get("find_unused_parameters", False):
            raise ValueError("kfuse.DistributedDataParallel does not support find_unused_parameters=True: it reduces "
                             "the encoders' gradients itself, which needs every rank's encoders in every synced "
                             "backward; use torch.nn.parallel.DistributedDataParallel for such a model")
        encoders = [(prefix, m) for prefix, m in module.named_modules() if isinstance(m, ResNetEncoder)]
        had_ignored = hasattr(module, "_ddp_params_and_buffers_to_ignore")
        ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", []))
        owned = {f"{prefix}.{n}" if prefix else n: p for prefix, m in encoders for n, p in m.named_parameters()}
        owned = {n: p for n, p in owned.items() if n not in ignored}  # what the user keeps out stays out
        if owned and not any(p.requires_grad for n, p in module.named_parameters() if n not in set(owned) | ignored):
            # DDP refuses a model with no trainable parameter of its own: it keeps one, the last of an encoder's
            # gradient buffer (the others stay back to back)
            prefix, enc = encoders[0]
            last = _param_list(enc, enc.config)[-1]
            del owned[next(n for n, p in owned.items() if p is last)]
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            module, sorted(ignored | set(owned)))
        try:
            super().__init__(module, *args, **kwargs)
        finally:  # DDP read the list in its constructor; left on the module, a later plain DDP would skip these
            if had_ignored:
                module._ddp_params_and_buffers_to_ignore = sorted(ignored)
            else:
                del module._ddp_params_and_buffers_to_ignore
        self._kfuse_sync = True
        if kwargs.get("init_sync", True):
            src = dist.get_global_rank(self.process_group, 0)
            with torch.no_grad():  # DDP broadcasts rank 0's parameters but not the ones it ignores
                for p in owned.values():
                    dist.broadcast(p.data, src=src, group=self.process_group)
        mine = {id(p) for p in owned.values()}
        left_to_ddp = {id(p) for _, enc in encoders for p in enc.parameters() if id(p) not in mine}
        self._kfuse_reducers = [_EncoderGradientReducer(enc, self, left_to_ddp) for _, enc in encoders]

    def forward(self, *inputs, **kwargs):
        # Whether the coming backward averages the gradients: DDP decides it at a forward that records a graph
        # (no_sync() around it); a forward without one (a target or bootstrap value) leaves the decision alone.
        if torch.is_grad_enabled():
            self._kfuse_sync = self.require_backward_grad_sync
            for r in self._kfuse_reducers:
                r.hook_trainable()
        return super().forward(*inputs, **kwargs)
