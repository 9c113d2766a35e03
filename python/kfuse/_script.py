"""TorchScript support for kfuse's modules. torch.jit.script compiles a module's `forward`, which for kfuse's modules
calls back into Python (an ignored method) with a script module as `self`; such a wrapper exposes none of the module's
parameters or Python state. This maps it back to the Python module it was scripted from (by a process-unique id,
which TorchScript carries over as an int attribute). The scripted forward also passes one of its parameters along, so
that a script module that no longer shares its parameters with that Python module (a copy of the script module) is
refused with an error instead of computing with the other module's weights."""

from __future__ import annotations

import itertools
import weakref

import torch

_UIDS = itertools.count(1)
_ORIGINALS: dict[int, weakref.ref] = {}


def register(module) -> int:
    """A process-unique id for a kfuse module."""
    uid = next(_UIDS)
    _ORIGINALS[uid] = weakref.ref(module, lambda _: _ORIGINALS.pop(uid, None))
    return uid


def python_module(module, cls, witness: torch.Tensor, witness_of):
    """`module` itself when it is a `cls`, else the `cls` a TorchScript module was scripted from. `witness` is the
    script module's parameter that `witness_of(python module)` names."""
    if isinstance(module, cls):
        return module
    ref = _ORIGINALS.get(int(module._kfuse_uid))
    original = ref() if ref is not None else None
    if original is None:
        raise RuntimeError(f"kfuse: the {cls.__name__} this TorchScript module was scripted from no longer exists "
                           "(scripted kfuse modules run in the process that scripted them, with that module)")
    if witness_of(original).data_ptr() != witness.data_ptr():
        raise RuntimeError(f"kfuse: this TorchScript module no longer shares its parameters with the {cls.__name__} "
                           "it was scripted from (a copy of a script module?); script a module that holds them")
    return original
