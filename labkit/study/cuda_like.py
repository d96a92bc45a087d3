"""What a CUDA GPU keeps, on this machine's CPU: ``CudaLike`` for ``labkit.study.counting``.

torch's CPU build cannot trace CUDA tensors through autograd (a fake ``cuda:0`` tensor that needs
a gradient aborts the process), so the CPU count is made to keep what CUDA keeps where the two
differ for a training step, each choice from torch's own source. Dropout and attention are
replaced at the dispatcher, as kernels of the aten ops ``aten::dropout`` and
``aten::scaled_dot_product_attention`` for the AutogradCPU key (above autograd, so autograd saves
what the replacement saves), registered while a ``CudaLike`` is active: every call reaches them,
``F.dropout`` and ``F.scaled_dot_product_attention`` as much as the ones inside C++ or Python
composites (``F.multi_head_attention_forward``, hence ``nn.MultiheadAttention`` and
``nn.TransformerEncoderLayer``; the math attention path's own dropout). The fp32 autocast ops are
cast up by the Python function called (a ``TorchFunctionMode``).

- dropout: CUDA's fused kernel (``native_dropout``) keeps a 1-byte bool mask; CPU's keeps a mask
  in the compute dtype (aten/src/ATen/native/Dropout.cpp, ``is_fused_kernel_acceptable``);
- scaled-dot-product attention: CUDA's flash, memory-efficient (and cuDNN) kernels keep query, key,
  value, the output and an fp32 log-sum-exp per row, no s x s scores
  (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp; derivatives.yaml);
- autocast: CUDA runs softmax, layer_norm, log_softmax, pow, ... in fp32 where CPU's autocast
  leaves them in the 16-bit dtype (aten/src/ATen/autocast_mode.h).

Limits: docs/measurement.md, "Counting a model".
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["CUDA_FP32_OPS", "cuda_attention_kernel", "CudaLike"]

CUDA_FP32_OPS = frozenset({
    # AT_FORALL_FP32 and AT_FORALL_FP32_SET_OPT_DTYPE of pytorch/pytorch v2.13
    # aten/src/ATen/autocast_mode.h, by Python name (functions, methods and operators)
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
    "rsqrt", "sinh", "tan", "pow", "__pow__", "__rpow__", "softplus", "layer_norm", "rms_norm", "group_norm",
    "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "hinge_embedding_loss",
    "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "prod", "softmax", "log_softmax", "cumprod", "cumsum", "sum", "norm", "cross_entropy"})
"""Ops CUDA's autocast runs in fp32 (casting 16-bit floating inputs up); ``cross_entropy`` is
there as its parts are (log_softmax, nll_loss). CPU autocast leaves several of them (softmax,
layer_norm, pow, ...) in the input's dtype."""

def cuda_attention_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any) -> str:
    """The SDPA kernel CUDA (sm80 and newer) picks for these inputs, as far as memory goes:
    "flash" (16-bit, no mask, head dim <= 256), else "efficient" (last dims divisible by 8 in
    16-bit, 4 in fp32: ``minimum_gemm_alignment``), else "math". Source: pytorch/pytorch
    aten/src/ATen/native/transformers/cuda/sdp_utils.cpp (``check_head_dim_size_flash``,
    ``check_head_dim_size_mem_efficient``; the flash -> efficient -> math order, with cuDNN's
    kernel first on sm90 when the cuDNN runtime allows, which keeps what flash keeps)."""
    half = q.dtype in (torch.float16, torch.bfloat16)
    d, dv = q.shape[-1], v.shape[-1]
    if half and attn_mask is None and d == k.shape[-1] == dv and d <= 256:
        return "flash"
    align = 8 if half else 4
    if d == k.shape[-1] and d % align == 0 and dv % align == 0 and d > 0 and dv > 0:
        return "efficient"
    return "math"


class _FusedAttention(torch.autograd.Function):
    """SDPA whose saved tensors are those of CUDA's fused kernels (``derivatives.yaml`` of
    pytorch/pytorch v2.13, ``_scaled_dot_product_{flash,efficient}_attention``): query, key,
    value, the output and an fp32 log-sum-exp [B, heads, rows] (rows = query length, rounded
    up to a multiple of 32 by the memory-efficient kernel), and the mask when one is passed.
    No s x s scores. For counting: its backward returns zero gradients of the right shapes."""

    @staticmethod
    def forward(ctx, q, k, v, mask, kernel, dropout_p, is_causal, scale, enable_gqa):
        # the op's own composite kernel (CPU's choice of path), past the AutogradCPU kernel CudaLike registers
        out = _SDPA.decompose(q, k, v, mask, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa)
        rows = q.shape[-2] if kernel == "flash" else 32 * math.ceil(q.shape[-2] / 32)
        lse = torch.empty(*q.shape[:-2], rows, dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse, *([mask] if isinstance(mask, torch.Tensor) else []))
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors[:3]
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None, None, None, None, None, None


_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_DROPOUT = torch.ops.aten.dropout.default


class CudaLike(TorchFunctionMode):
    """Make a CPU forward keep what the same forward keeps on a CUDA GPU (see the module
    docstring). While active, two aten ops get a kernel for the AutogradCPU dispatch key
    (``torch.library``; removed on exit): ``aten::dropout`` in training with 0 < p < 1 ->
    ``aten::native_dropout`` (1-byte bool mask, as CUDA's ``is_fused_kernel_acceptable`` path in
    aten/src/ATen/native/Dropout.cpp); ``aten::scaled_dot_product_attention`` -> ``_FusedAttention``
    when ``cuda_attention_kernel`` is flash or efficient (math stays CPU's composite, whose own
    dropout then takes the first kernel). Autocast has cast SDPA's inputs before the AutogradCPU
    key (its AutocastCPU kernel runs first), as CUDA's does. As a ``TorchFunctionMode``, while
    autocast is on, it casts the 16-bit floating inputs of ``CUDA_FP32_OPS`` up to fp32.
    ``kernels`` lists the attention kernel chosen per SDPA call, ``dropouts`` counts the dropout
    calls given CUDA's mask, ``upcast`` names the ops cast up. Not thread-safe: the kernels are
    the process's while it is active (one ``CudaLike`` at a time; nested ones share them)."""

    _active: list["CudaLike"] = []
    _library: Any = None

    def __init__(self) -> None:
        super().__init__()
        self.kernels: list[str] = []
        self.dropouts = 0
        self.upcast: set[str] = set()

    def __enter__(self):
        if not CudaLike._active:
            lib = torch.library.Library("aten", "IMPL")
            lib.impl("dropout", CudaLike._dropout, "AutogradCPU")
            lib.impl("scaled_dot_product_attention", CudaLike._attention, "AutogradCPU")
            CudaLike._library = lib
        CudaLike._active.append(self)
        try:
            return super().__enter__()
        except BaseException:
            self._release()
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._release()

    def _release(self) -> None:
        CudaLike._active.remove(self)
        if not CudaLike._active:
            CudaLike._library._destroy()
            CudaLike._library = None

    @staticmethod
    def _dropout(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
        """``aten::dropout`` as CUDA runs it: the fused ``native_dropout`` (bool mask) in training
        for 0 < p < 1 and a non-empty input, else the op's own composite kernel."""
        if train and 0.0 < p < 1.0 and input.numel() > 0:
            CudaLike._active[-1].dropouts += 1
            return torch.ops.aten.native_dropout.default(input, p, True)[0]
        return _DROPOUT.decompose(input, p, train)

    @staticmethod
    def _attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                   enable_gqa=False):
        """``aten::scaled_dot_product_attention`` as CUDA runs it (``cuda_attention_kernel``)."""
        kernel = cuda_attention_kernel(query, key, value, attn_mask)
        CudaLike._active[-1].kernels.append(kernel)
        if kernel == "math":
            return _SDPA.decompose(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                   enable_gqa=enable_gqa)
        return _FusedAttention.apply(query, key, value, attn_mask, kernel, dropout_p, is_causal, scale, enable_gqa)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.is_autocast_enabled("cpu") and getattr(func, "__name__", "") in CUDA_FP32_OPS:
            up = (lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype in (torch.bfloat16, torch.float16)
                  else t)
            if any(isinstance(t, torch.Tensor) and t.dtype in (torch.bfloat16, torch.float16)
                   for t in (*args, *kwargs.values())):
                self.upcast.add(func.__name__)
            args, kwargs = tuple(up(a) for a in args), {k: up(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)
