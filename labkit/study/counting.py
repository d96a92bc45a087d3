"""What one training step of any model keeps and computes, counted on this machine's CPU.

The instrument behind ``labkit.study.memory.plan_model``. ``count_steps`` runs one training
forward and backward of ``model(**batch)`` (train mode) per micro-batch and counts, exactly:

- ``saved_bytes``: the distinct tensor storages autograd keeps for backward (every tensor
  passed to ``torch.autograd.graph.saved_tensors_hooks`` during the forward), parameters and
  buffers excluded; ``param_cast_bytes`` is the part of it that is autocast's low-precision
  copies of parameters (``aten._to_copy`` of a parameter's storage);
- ``held_bytes``: storages of the forward's outputs that are not saved (the logits a training
  loop holds while it runs backward);
- ``peak_bytes``: the largest sum of live storages the step itself created, forward and
  backward, parameter gradients excluded (model state): a ``TorchDispatchMode`` records each
  op's new output storages and a weakref callback each one's end, as
  ``torch.distributed._tools.mem_tracker.MemTracker`` does (tests/study/test_counting.py
  compares the two);
- ``flops`` (``count_flops``): ``torch.utils.flop_counter.FlopCounterMode`` over the same
  forward and backward, with CPU's fused attention kernel given the formula FlopCounterMode
  has for CUDA's (it counts 0 for it otherwise).

It runs on fake tensors (``torch._subclasses.fake_tensor.FakeTensorMode``: the shapes, dtypes,
strides and views of real tensors, no data, no arithmetic) when the model allows it, else on
real CPU tensors. A model may read integer data on the host (``int(t)``, ``bool(t)``, a
boolean-mask index: labkit's sparse MLM head counts its masked positions, transformers checks
its attention mask): ``_IntegerShadow`` answers those from real copies of the integer tensors;
a model that reads floating data on the host needs real tensors. Both give the same bytes.

``cuda=True`` counts what the step keeps on a CUDA GPU instead (``labkit.study.cuda_like``),
since this CPU build of torch cannot trace CUDA tensors through autograd. Limits:
docs/measurement.md, "Counting a model".
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from labkit.study.cuda_like import CudaLike

__all__ = ["CONTRACT", "ModelContractError", "count_steps", "loss_of", "parameter_table"]

CONTRACT = ("make_model() returns a torch.nn.Module; make_batch(b) returns a dict of its forward's keyword "
            "arguments with int64 input ids [b, seq_len] among them; the forward returns the scalar loss (a tensor, "
            "or an object with .loss)")
"""What ``count_steps`` needs of a model, as its errors (``ModelContractError``) state it."""


class ModelContractError(TypeError, ValueError):
    """A model, batch or loss that breaks ``CONTRACT``: the message names what was given and ends
    with what the contract wants. A TypeError (what was given has the wrong type) and a
    ValueError (bad input: ``labkit plan`` reports it in one line, exit 2)."""


def _broken(what: str) -> ModelContractError:
    return ModelContractError(f"{what}; the contract: {CONTRACT}")


def _user_call(what: str, fn: Callable, *args: Any) -> Any:
    """``fn(*args)``, a function of the user's model module: an exception it raises (other than a
    fake-tensor refusal, ``_FAKE_REFUSALS``, which moves the count to CPU tensors) becomes a
    ``ModelContractError`` naming ``what`` raised it (``--debug`` shows the traceback)."""
    try:
        return fn(*args)
    except (ModelContractError, *_FAKE_REFUSALS):
        raise
    except Exception as err:  # the user's own code: one line, the traceback under --debug
        raise ModelContractError(f"{what} raised {type(err).__name__}: {err}".splitlines()[0][:300]) from err

AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}

_FAKE_REFUSALS = (torch._subclasses.fake_tensor.DataDependentOutputException,
                  torch._subclasses.fake_tensor.DynamicOutputShapeException,
                  torch._subclasses.fake_tensor.UnsupportedOperatorException, NotImplementedError, RuntimeError)


def _key(t: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(t.untyped_storage())


def loss_of(out: Any) -> torch.Tensor:
    """The scalar to call backward on: ``out`` itself when it is a tensor, else ``out.loss``
    (transformers' outputs) or ``out.loss_sum`` (labkit's ``MLMOutput``). ``ModelContractError``
    (a TypeError) naming what the forward returned otherwise: a dict (even one holding "loss"),
    a tensor of more than one element, anything else."""
    for loss in (out, getattr(out, "loss", None), getattr(out, "loss_sum", None)):
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                raise _broken(f"forward: the loss must be a scalar, got a tensor of shape {tuple(loss.shape)}")
            return loss
    keys = f" with keys {sorted(map(str, out))[:5]}" if isinstance(out, dict) else ""
    raise _broken(f"forward: returned a {type(out).__name__}{keys}, not a loss tensor or an object with .loss or "
                  ".loss_sum")


class _LiveStorages(TorchDispatchMode):
    """Every storage an op creates, alive or freed, in order: ``events`` [(key, +bytes or -bytes)].
    A storage's end is a ``weakref`` callback on its Python object (torch keeps one object per
    storage while it lives, as MemTracker relies on). Storages of ``exclude`` (parameters,
    buffers) are never counted; ``casts`` are the keys made by ``_to_copy`` of an excluded
    storage (autocast's weight copies)."""

    def __init__(self, exclude: set) -> None:
        super().__init__()
        self.exclude, self.live, self.casts, self.events = exclude, {}, set(), []

    def _freed(self, key: StorageWeakRef) -> None:
        self.events.append((key, -self.live.pop(key)[0]))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        cast_of_param = func is torch.ops.aten._to_copy.default and _key(args[0]) in self.exclude
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                storage = t.untyped_storage()
                key = StorageWeakRef(storage)
                if key not in self.exclude and key not in self.live:
                    n = storage.nbytes()
                    self.live[key] = (n, weakref.ref(storage, lambda _, key=key: self._freed(key)))
                    self.events.append((key, n))
                    if cast_of_param:
                        self.casts.add(key)
        return out

    def peak(self, skip: set) -> int:
        """Largest running sum of the recorded storages, leaving out the keys in ``skip``."""
        now = best = 0
        for key, n in self.events:
            if key not in skip:
                now += n
                best = max(best, now)
        return best


class _IntegerShadow(TorchDispatchMode):
    """Answers a fake-tensor model's host-side reads of integer data: every non-floating tensor
    derived from the batch's integer inputs (ids, labels, masks) and from integer factories
    (``arange``) keeps a real copy beside its fake one, computed on the CPU (cheap: [b, s] index
    arithmetic). An op fake tensors cannot answer (``item()``/``bool()`` of such a tensor, a
    boolean-mask index, ``nonzero``) is answered from the real copies; a read of floating data
    still refuses, and the model then runs on CPU tensors. This lets labkit's sparse head (which
    counts its masked positions) and transformers' mask checks run on fake tensors."""

    def __init__(self, fake_mode) -> None:
        super().__init__()
        from torch.utils.weak import WeakIdKeyDictionary

        self.fake_mode, self.real = fake_mode, WeakIdKeyDictionary()

    def shadowed(self, real: torch.Tensor) -> torch.Tensor:
        """The fake tensor for ``real`` (kept as its shadow when it is not floating)."""
        fake = self.fake_mode.from_tensor(real)
        if not (real.is_floating_point() or real.is_complex()):
            self.real[fake] = real
        return fake

    def _real(self, x):
        return self.real.get(x, x) if isinstance(x, torch.Tensor) else x

    def _integer_indices(self, indices):
        """``indices`` of an index op with each known boolean mask replaced by the integer
        positions of its True entries (as torch expands it), so the result's shape is known."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        out = []
        for idx in indices:
            if isinstance(idx, torch.Tensor) and idx.dtype == torch.bool and idx in self.real:
                with unset_fake_temporarily():
                    cols = self.real[idx].nonzero().unbind(1)
                out.extend(self.shadowed(c) for c in cols)
            else:
                out.append(idx)
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.utils._pytree import tree_map

        kwargs = kwargs or {}
        if func in (torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default):
            args = (args[0], self._integer_indices(args[1]), *args[2:])  # x[mask]: the mask's positions, known
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        known = all(t in self.real for t in tensors)
        try:
            out = func(*args, **kwargs)
        except (torch._subclasses.fake_tensor.DataDependentOutputException,
                torch._subclasses.fake_tensor.DynamicOutputShapeException):
            if not (known and tensors):
                raise
            with unset_fake_temporarily():
                real = func(*tree_map(self._real, args), **tree_map(self._real, kwargs))
            return tree_map(lambda r: self.shadowed(r) if isinstance(r, torch.Tensor) else r, real)
        if known:  # keep the real copies of integer results (views stay views of their real base)
            fakes = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            if fakes and not any(t.is_floating_point() or t.is_complex() for t in fakes):
                with unset_fake_temporarily():
                    real = func(*tree_map(self._real, args), **tree_map(self._real, kwargs))
                for fake, r in zip(fakes, [r for r in tree_leaves(real) if isinstance(r, torch.Tensor)]):
                    self.real[fake] = r
        return out


def _flops_mapping() -> dict:
    """FlopCounterMode formulas for CPU's fused SDPA kernel, which it counts as 0 otherwise:
    forward ``torch.utils.flop_counter.sdpa_flop_count`` (the formula torch registers for CUDA's
    kernels), backward twice that (the four gradient matmuls; torch's CUDA formula also counts
    the kernel's recompute of the scores, which model FLOPs leave out)."""
    from torch.utils.flop_counter import sdpa_flop_count

    aten = torch.ops.aten
    return {aten._scaled_dot_product_flash_attention_for_cpu:
            lambda q, k, v, *a, out_shape=None, **kw: sdpa_flop_count(q, k, v),
            aten._scaled_dot_product_flash_attention_for_cpu_backward:
            lambda g, q, k, v, *a, out_shape=None, **kw: 2 * sdpa_flop_count(q, k, v)}


def _checked_batch(batch: Any, b: int) -> dict[str, Any]:
    """``make_batch(b)``'s result when it keeps ``CONTRACT`` (a dict holding an int64 tensor
    [b, T], the input ids), else ``ModelContractError`` naming what it returned."""
    if not isinstance(batch, dict):
        raise _broken(f"make_batch({b}) returned a {type(batch).__name__}, not a dict of keyword arguments")
    if not any(isinstance(v, torch.Tensor) and v.dtype == torch.int64 and v.ndim == 2 and v.shape[0] == b
               for v in batch.values()):
        got = {k: f"{str(v.dtype).removeprefix('torch.')} {list(v.shape)}" if isinstance(v, torch.Tensor)
               else type(v).__name__ for k, v in batch.items()}
        raise _broken(f"make_batch({b}) holds no int64 tensor [{b}, seq_len] of input ids (got {got})")
    return batch


def _tokens(batch: dict[str, Any], b: int) -> int:
    """Positions in the micro-batch: numel of the first int64 tensor [b, T] of the batch (the
    input ids; ``_checked_batch`` made sure there is one)."""
    return next(int(v.numel()) for v in batch.values()
                if isinstance(v, torch.Tensor) and v.dtype == torch.int64 and v.ndim == 2 and v.shape[0] == b)


def _one_step(model: torch.nn.Module, batch: dict[str, Any], *, precision: str, cuda: bool,
              flops: bool) -> dict[str, Any]:
    """One forward + backward of ``model(**batch)`` in train mode: the counts of the module
    docstring (and ``flops`` when asked: then without ``CudaLike``, whose attention backward does
    no arithmetic)."""
    state = {_key(t) for t in (*model.parameters(), *model.buffers())}
    model.train()
    model.zero_grad(set_to_none=True)
    saved: dict[StorageWeakRef, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.layout == torch.strided:
            key = _key(t)
            if key not in state:
                saved[key] = t.untyped_storage().nbytes()
        return t

    dtype = AUTOCAST[precision]
    tracker = _LiveStorages(state)
    counter = None
    emulate = CudaLike() if cuda and not flops else None  # labkit.study.cuda_like
    with contextlib.ExitStack() as stack:
        if flops:
            from torch.utils.flop_counter import FlopCounterMode

            counter = stack.enter_context(FlopCounterMode(display=False, custom_mapping=_flops_mapping()))
        stack.enter_context(tracker)
        if emulate is not None:
            stack.enter_context(emulate)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                out = model(**batch)
        loss = loss_of(out)
        held = {_key(t): t.untyped_storage().nbytes() for t in tree_leaves(dict(out) if hasattr(out, "keys") else out)
                if isinstance(t, torch.Tensor) and t.layout == torch.strided}
        held = {k: n for k, n in held.items() if k not in saved and k not in state}
        # the engine call of torch.autograd.backward: Tensor.backward is overridable, and a
        # torch-function mode is off while it handles a call, so CudaLike would be off for the
        # recomputed forwards of activation checkpointing
        torch.autograd.graph._engine_run_backward((loss,), (torch.ones_like(loss),), False, False, (),
                                                  allow_unreachable=True, accumulate_grad=True)
        grads = {_key(p.grad) for p in model.parameters() if p.grad is not None}
        del out, loss
    result = {"saved_bytes": sum(saved.values()),
              "param_cast_bytes": sum(n for k, n in saved.items() if k in tracker.casts),
              "held_bytes": sum(held.values()), "peak_bytes": tracker.peak(grads),
              "attention_kernels": emulate.kernels if emulate is not None else [],
              "dropout_calls": emulate.dropouts if emulate is not None else 0,
              "fp32_ops": sorted(emulate.upcast) if emulate is not None else [],
              "flops": counter.get_total_flops() if counter is not None else None}
    model.zero_grad(set_to_none=True)
    return result


def parameter_table(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Unique parameters in registration order (tied ones once): name, shape, numel, dtype
    bytes, requires_grad, and ``unit``: the index of the module of the model's largest
    ``ModuleList`` (its blocks, FSDP's units as labkit wraps ``model.layers``) that holds it,
    None for the rest (embeddings, head: FSDP's root)."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    blocks = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()), default=None)
    owner = {}
    if blocks is not None:
        for i, block in enumerate(blocks):
            owner.update({id(p): i for p in block.parameters()})
    rows, seen = [], set()
    for name, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            rows.append({"name": name, "shape": tuple(p.shape), "numel": p.numel(), "bytes": p.element_size(),
                         "requires_grad": p.requires_grad, "unit": owner.get(id(p))})
    return rows


def count_steps(make_model: Callable[[], torch.nn.Module], make_batch: Callable[[int], dict[str, Any]],
                micro_batches: tuple[int, ...], *, precision: str = "fp32", cuda: bool = False,
                flops_at: int | None = None, fake: bool = True,
                param_dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Count one training step at each micro-batch in ``micro_batches`` (see the module docstring).

    ``make_model()`` returns a ``torch.nn.Module``; ``make_batch(b)`` the keyword arguments of
    its forward for micro-batch b; the forward returns the loss (``loss_of``). ``precision``:
    "fp32", or "bf16"/"fp16" autocast. ``cuda``: count what a CUDA GPU would keep
    (``CudaLike``). ``flops_at``: also count FLOPs at this micro-batch. ``fake``: try fake
    tensors first. ``param_dtype``: run the forward with the parameters in this dtype (FSDP's
    mixed-precision policy); the parameter table keeps the dtype ``make_model`` gave.

    Returns {"method" ("fake tensors" or "CPU tensors"), "fake_refused" (why fake tensors could
    not run the model, or None), "counts" {b: {saved_bytes, param_cast_bytes, held_bytes,
    peak_bytes, attention_kernels, dropout_calls, fp32_ops, tokens}}, "flops" (fwd + bwd at
    flops_at, or None), "flops_tokens", "parameters" (``parameter_table``), "model_class"}.
    A model, batch or loss outside ``CONTRACT``, and an exception raised by ``make_model`` or
    ``make_batch``, raise ``ModelContractError`` naming it; errors of the model's forward propagate.
    """
    if precision not in AUTOCAST:
        raise ValueError(f"precision: got {precision!r}; allowed values are {tuple(AUTOCAST)}")
    refused = None
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        try:
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            shadow = _IntegerShadow(mode)

            def fake_batch(b: int) -> dict[str, Any]:  # the real batch (ids: cheap), then its fake twin
                from torch.utils._python_dispatch import _disable_current_modes

                with _disable_current_modes():
                    batch = _checked_batch(_user_call(f"make_batch({b})", make_batch, b), b)
                return {k: shadow.shadowed(v) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

            # torch warns that a FakeTensor's data pointer was read when a model is built by
            # copy.deepcopy of a module (nn.TransformerEncoder's layers): Tensor.__deepcopy__
            # asks a tensor subclass for data_ptr() to choose clone() (torch/_tensor.py), which is
            # what fake tensors need; the warning is about torch's own check, not the model's
            with mode, shadow, warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
                return _count(make_model, fake_batch, micro_batches, precision, cuda, flops_at, param_dtype) | \
                    {"method": "fake tensors", "fake_refused": None}
        except _FAKE_REFUSALS as err:
            refused = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
    return _count(make_model, make_batch, micro_batches, precision, cuda, flops_at, param_dtype) | \
        {"method": "CPU tensors", "fake_refused": refused}


def _count(make_model, make_batch, micro_batches, precision, cuda, flops_at, param_dtype) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _user_call("make_model()", make_model)
    if not isinstance(model, torch.nn.Module):
        raise _broken(f"make_model() returned a {type(model).__name__}, not a torch.nn.Module")
    table = parameter_table(model)
    if param_dtype is not None:
        model.to(param_dtype)
    counts = {}
    for b in micro_batches:
        batch = _checked_batch(_user_call(f"make_batch({b})", make_batch, b), b)
        counts[b] = _one_step(model, batch, precision=precision, cuda=cuda, flops=False) | {"tokens": _tokens(batch, b)}
    flops = tokens = None
    if flops_at is not None:
        batch = _checked_batch(_user_call(f"make_batch({flops_at})", make_batch, flops_at), flops_at)
        flops = _one_step(model, batch, precision="fp32", cuda=False, flops=True)["flops"]
        tokens = _tokens(batch, flops_at)
    return {"counts": counts, "flops": flops, "flops_tokens": tokens, "parameters": table,
            "model_class": type(model).__name__}
