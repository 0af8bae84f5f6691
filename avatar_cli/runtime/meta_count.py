"""Counting a model's memory without memory: parameter bytes and activation peaks on the meta device.

A model built on meta has every parameter's shape and dtype and no storage, and a forward on meta runs every op's
shape logic without computing, so the bytes a forward allocates can be counted on any machine, at any size:

- `LiveBytes`: the most bytes held at once by the storages ops allocate while it is active (weights and inputs
  excluded; a view or an in-place result is not an allocation; a storage leaves the count when torch frees it);
- `FusedAttention`: every F.scaled_dot_product_attention allocates what a fused (flash) kernel does on a GPU, its
  output and a float32 logsumexp, not the math path's N x M scores (86 GB at Wan's 480p);
- `peak_and_flops`: the peak and the FLOPs of one forward in one run on meta (a full-size forward on meta is
  slow Python dispatch: counting both in one pass halves what `avatar plan` waits for).

`avatar plan` and bench/wan_budget.py count with these. The CUDA caching allocator rounds blocks up and
fragments, so a real peak is somewhat above the count; `bench/gpu_check.py --sections wan` measures it on a GPU.
"""

import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """The most bytes held at once by storages that ops allocate while active. A storage that an op's inputs
    already hold (views, in-place results) is not counted; a storage leaves the count when torch frees it."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._ids: set[int] = set()

    def _freed(self, key: int, size: int) -> None:
        self._ids.discard(key)
        self.live -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # A view or in-place result shares an input's storage: not an allocation (a weight's .t() above all).
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if id(st) not in self._ids and id(st) not in inputs:  # one Python object per live storage
                    self._ids.add(id(st))
                    self.live += st.nbytes()
                    weakref.finalize(st, self._freed, id(st), st.nbytes())
        self.peak = max(self.peak, self.live)
        return out


class FusedAttention(TorchFunctionMode):
    """Every F.scaled_dot_product_attention allocates what a fused (flash) kernel does: its output (B, H, N, Dv)
    and a logsumexp (B, H, N) fp32, instead of the math path's N x M scores. `flops`: the attentions' FLOPs, by
    torch's own formula (sdpa_flop_count: the two matmuls a FlopCounterMode counts on the math path)."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            from torch.utils.flop_counter import sdpa_flop_count  # imports triton: only where a count runs

            kw = kwargs or {}
            q = args[0] if args else kw["query"]  # (B, H, N, D), passed by position or by name
            k = args[1] if len(args) > 1 else kw["key"]
            v = args[2] if len(args) > 2 else kw["value"]
            self.flops += sdpa_flop_count(*((1,) * (4 - t.dim()) + tuple(t.shape) for t in (q, k, v)))
            torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)  # logsumexp, freed at once
            return q.new_empty((*q.shape[:-1], v.shape[-1]))  # (B, H, N, Dv)
        return func(*args, **(kwargs or {}))


def peak_bytes(fn) -> int:
    """Peak bytes allocated by fn() beyond what already exists (weights, inputs), attention fused."""
    tracker = LiveBytes()
    with torch.no_grad(), FusedAttention(), tracker:
        fn()
    return tracker.peak


def peak_and_flops(fn) -> tuple[int, float]:
    """(peak_bytes(fn), the FLOPs of fn()) from one run: the matmuls and convolutions a FlopCounterMode counts, and
    the attentions FusedAttention stands in for by their formula."""
    from avatar_cli.runtime.flops import flop_counter

    tracker, attention, counter = LiveBytes(), FusedAttention(), flop_counter()
    with torch.no_grad(), attention, counter, tracker:
        fn()
    return tracker.peak, float(counter.get_total_flops() + attention.flops)


def on_meta(cls, params, dtype: torch.dtype) -> nn.Module:
    """cls(params) built on the meta device in `dtype`, in eval mode: shapes and dtypes, no storage."""
    with torch.device("meta"):
        return cls(params).to(dtype).eval()


def n_bytes(model: nn.Module) -> int:
    """Parameter bytes (a tied weight once, as parameters() lists it)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
