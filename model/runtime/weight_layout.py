"""The engine's projection weights kept input-major.

Every projection of the model is ``F.linear(x, w)``: ``x`` times the transpose of a
weight ``w`` [out, in]. Kept as loaded, row-major [out, in], that transpose is a
strided view that MKL's GEMM packs column by column; a decode step's product has a few
rows (one per token: 1-16), so that packing is most of it. Kept input-major, the
transpose is a row-major [in, out] matrix that MKL reads as it is. On the 2-core AMD
EPYC of docs/performance.md, 16 rows with the weights out of cache (as a step that
reads every layer's finds them): 128 -> 768 in 78 us against 117, the output head
(128 -> 4,096) 476 against 632, the small projections of attention and mHC (24-256
outputs) 12-14 us against 16-21.

:func:`store_input_major` re-seats each projection weight of a model as the transpose
of an input-major copy: every module and formula still sees the same [out, in] tensor,
with the same values, and a weight loaded later (``copy_``) lands in the new storage.
The compiled step's packages are built for the strides they are given
(:mod:`model.runtime.aot`), so they read the weights as they are kept.
"""

from __future__ import annotations

import torch
from torch import nn

from model.moe import Router


def _projections(model: nn.Module):
    """Every weight the model applies with ``F.linear``: the linear layers', the MoE
    routers' and the mHC mixes' (``hc_<site>_fn``)."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, Router)):
            yield module.weight
        for name, param in module.named_parameters(recurse=False):
            if name.startswith("hc_") and name.endswith("_fn"):
                yield param


def store_input_major(model: nn.Module) -> int:
    """Keep every projection weight of ``model`` input-major (see the module
    docstring); a weight already strided (a view of a stack of experts, or kept
    input-major before) stays as it is. Returns how many moved."""
    moved = 0
    with torch.no_grad():
        for weight in _projections(model):
            if weight.dim() == 2 and weight.is_floating_point() and weight.is_contiguous() and min(weight.shape) > 1:
                weight.data = weight.data.t().contiguous().t()
                moved += 1
    return moved
