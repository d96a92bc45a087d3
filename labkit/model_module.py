"""``labkit plan --model-module FILE.py:FACTORY``: your own model, counted rather than estimated.

The factory's contract is ``labkit.cli.FACTORY_CONTRACT``; every mistake against it (a factory
that raises, returns something else than two callables, a model that is not an ``nn.Module``, a
batch without int64 input ids, a loss that is a dict or not a scalar) is one line naming what
was wrong and what the contract wants (``labkit.study.counting.ModelContractError``), exit 2.
Unknown networks and precisions without a peak are refused before the count starts.
"""

from __future__ import annotations

import pathlib
import sys
from typing import Any

from labkit.planning import (GPU_COUNTS, SCALING_NOTE, check_network, peak_text, print_json, print_table,
                             scaling_view)

__all__ = ["load_model_module", "plan_model_module", "print_plan_model"]


def load_model_module(spec: str, **factory_kw) -> tuple[Any, Any]:
    """``(make_model, make_batch)`` from ``"FILE.py:FACTORY"``: the file is imported under its
    own name and ``FACTORY(**factory_kw)`` is called (``seq_len``, and ``vocab_size`` when asked;
    ``labkit.cli.FACTORY_CONTRACT``). ValueError naming the problem and the contract (no ':', no
    such function, a factory whose signature cannot take ``factory_kw``, one that raises, one that
    does not return two callables); FileNotFoundError for a missing file."""
    import importlib.util
    import inspect

    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise ValueError(f"model_module: expected FILE.py:FACTORY, got {spec!r}")
    file = pathlib.Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"model_module: {file} does not exist")
    module_spec = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(module_spec)
    sys.path.insert(0, str(file.resolve().parent))  # the file may import its neighbours
    try:
        module_spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(file.resolve().parent))
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ValueError(f"model_module: {file} has no function {name!r}")
    signature = inspect.signature(factory)
    called = f"{name}({', '.join(f'{k}={v!r}' for k, v in factory_kw.items())})"
    contract = "the contract: FACTORY(seq_len) -> (make_model, make_batch), labkit plan --help"
    named = {n for n, prm in signature.parameters.items() if prm.kind is not prm.VAR_KEYWORD}
    if "vocab_size" in factory_kw and "vocab_size" not in named:
        raise ValueError(f"--vocab-size: {name}{signature} has no vocab_size parameter; set the vocabulary in "
                         f"{name} or give it a vocab_size parameter")
    try:
        signature.bind(**factory_kw)
    except TypeError as err:
        raise ValueError(f"model_module: {name}{signature} cannot be called as {called} ({err}); {contract}") from None
    try:
        made = factory(**factory_kw)
    except Exception as err:  # the user's own code: one line, the traceback under --debug
        raise ValueError(f"model_module: {called} raised {type(err).__name__}: {err}".splitlines()[0][:300]) from err
    if not (isinstance(made, tuple) and len(made) == 2 and all(callable(f) for f in made)):
        raise ValueError(f"model_module: {called} returned a {type(made).__name__}, not two callables; {contract}")
    return made


def print_plan_model(p: dict[str, Any], *, label: str = "") -> None:
    """``labkit.study.memory.plan_model``'s answer as a readable table: the max micro-batch, the
    terms behind it (state, activations, transients, each with its bytes), FLOPs per token,
    and what the count corrected for the device."""
    gb = 1e9
    at = max(p["max_micro_batch"], 1)
    st, act, tr = p["state_terms"], p["activation_terms"], p["transient_terms"]
    rows = [("state: parameters", st["params"]), ("state: gradients", st["grads"]),
            ("state: DDP buckets (beside the gradients)", st["buckets"]),
            (f"state: {p['optimizer']} state", st["optimizer"]), ("state: optimiser steps", st["optimizer_steps"]),
            ("activations: per sequence", act["per_sequence"]), ("activations: fixed", act["fixed"]),
            ("  of which autocast weight copies", act["autocast_weight_copies"]),
            ("transient: held outputs per sequence", tr["held_outputs_per_sequence"]),
            ("transient: backward temporaries per sequence", tr["backward_per_sequence"]),
            ("transient: backward temporaries fixed", tr["backward_fixed"]),
            ("transient: FSDP gathered units", tr["fsdp_gathered"]),
            (f"transient: {p['optimizer_impl']} optimiser step", tr["optimizer_step"])]
    print(f"plan_model {label}{p['model']} on {p['device']}, {p['precision']}, {p['sharding']} over {p['dp']} "
          f"rank(s) (ZeRO stage {p['zero_stage']}), seq {p['seq_len']}, {p['params'] / 1e6:.1f} M parameters, "
          f"counted on {p['method']}")
    width = max(len(r[0]) for r in rows)
    print(f"{'term':<{width}}  {'bytes':>16}  {'GB':>9}")
    for name, value in rows:
        print(f"{name:<{width}}  {value:>16,}  {value / gb:>9.3f}")
    print(f"{'total at micro-batch ' + str(at):<{width}}  {p['total_bytes']:>16,}  {p['total_bytes'] / gb:>9.3f}")
    print(f"{'capacity':<{width}}  {p['capacity_bytes']:>16,}  {p['capacity_bytes'] / gb:>9.3f}")
    check = (f"verified by counting at {p['verified']['micro_batch']} and {p['verified']['micro_batch'] + 1}"
             if p["verified"] else "linear from the counts at b = 2, 3 (not counted at the answer)")
    print(f"max micro-batch: {p['max_micro_batch']} ({check})")
    print(f"FLOPs per token (forward + backward, FlopCounterMode): {p['flops_per_token']:,.0f}")
    for line in p["corrections"]:
        print(f"  corrected: {line}")
    for line in p.get("not_modelled", ()):
        print(f"  not modelled: {line}")
    if p["fake_refused"]:
        print(f"  CPU tensors because fake tensors could not run the model: {p['fake_refused']}")
    if p["device"] == "cpu":
        from labkit.measure import cpu_rss_caveat

        print(cpu_rss_caveat(p["capacity_bytes"]))


def plan_model_module(args, given: set[str]) -> int:
    """``labkit plan --model-module FILE.py:FACTORY``: the user's model counted
    (``labkit.study.memory.plan_model``) at ``args.seq_len`` on ``args.device``, sharded
    ``args.sharding`` over ``args.dp`` ranks (default: ``args.gpus``), then the predicted
    data-parallel scaling from 1 GPU to ``args.gpus`` over ``args.network`` from the counted
    parameters and FLOPs per token (``labkit.study.scaling.model_scaling``, the presets' path) at
    ``args.micro_batch`` (default: the counted largest one; a given one is also checked against
    the memory) and ``args.precision``'s peak. ``given``: the options set on the command line.
    Options that cannot apply are refused in one line (ValueError) before anything is counted:
    --model, --top (the dp x tp x pp splits need a preset's layer shapes), CONFIG's
    --set/--count/--out, --vocab-size when the factory takes no ``vocab_size``, the scaling
    options with --device cpu (no peak FLOPs), an unknown network and a precision without a peak
    on the device; a factory outside its contract is one line too
    (``labkit.study.counting.ModelContractError``)."""
    from labkit.study import memory, scaling

    refused = [flag for flag, on in (("--model", "model" in given), ("--top", "top" in given),
                                     ("--set", bool(getattr(args, "set", None))),
                                     ("--count", getattr(args, "count", False)),
                                     ("--out", getattr(args, "out", None) is not None)) if on]
    why = {"--model": "the model is FACTORY's", "--top": "the dp x tp x pp splits need a labkit preset's layer shapes",
           "--set": "it overrides a CONFIG", "--count": "a FACTORY's model is always counted",
           "--out": "it writes a CONFIG plan's summary (use --json)"}
    if args.device == "cpu":
        refused += [f"--{k.replace('_', '-')}" for k in ("gpus", "gpus_per_node", "network") if k in given]
        why |= dict.fromkeys(("--gpus", "--gpus-per-node", "--network"),
                             "the scaling table needs a GPU's peak FLOPs (give --device)")
    if refused:
        raise ValueError(f"{refused[0]}: does not apply with --model-module ({why[refused[0]]})")
    if args.device != "cpu":
        check_network(args.network)
        peak = peak_text(args.device, args.precision, 0.4)  # checked here, before the count
    kw = {"seq_len": args.seq_len} | ({"vocab_size": args.vocab_size} if args.vocab_size is not None else {})
    make_model, make_batch = load_model_module(args.model_module, **kw)
    budget = int(args.budget_gb * 1e9) if args.budget_gb else None
    dp = args.dp if args.dp is not None else args.gpus if args.device != "cpu" else 1
    p = memory.plan_model(make_model, make_batch, device=args.device, precision=args.precision, budget_bytes=budget,
                          sharding=args.sharding, dp=dp)
    batch = args.micro_batch if "micro_batch" in given else max(p["max_micro_batch"], 1)
    at = {"micro_batch": batch, "total_bytes": memory.total_at(p, batch),
          "fits": memory.total_at(p, batch) <= p["capacity_bytes"], "capacity_bytes": p["capacity_bytes"]}
    table = None
    if args.device != "cpu":
        table = scaling.model_scaling(params=p["params"], flops_per_token=p["flops_per_token"], micro_batch=batch,
                                      seq_len=p["seq_len"], device=args.device, precision=args.precision,
                                      gpus=tuple(g for g in GPU_COUNTS if g <= args.gpus), network=args.network,
                                      gpus_per_node=args.gpus_per_node, params_ready_last=p["params_before_blocks"])
    if getattr(args, "json", False):
        print_json({"model_module": args.model_module, "plan": p, "at_micro_batch": at,
                    "scaling": None if table is None else table.to_dicts(),
                    "scaling_inputs": None if table is None else
                    {"params": p["params"], "flops_per_token": p["flops_per_token"], "micro_batch": batch,
                     "seq_len": p["seq_len"], "network": args.network, "gpus_per_node": args.gpus_per_node,
                     "mfu": 0.4, "precision": args.precision, "grad_dtype_bytes": 4,
                     "params_ready_last": p["params_before_blocks"]}})
        return 0
    print_plan_model(p, label=f"{args.model_module}: ")
    if "micro_batch" in given:
        print(f"at micro-batch {batch}: {at['total_bytes'] / 1e9:.3f} GB of {at['capacity_bytes'] / 1e9:.3f} GB: "
              + ("fits" if at["fits"] else "does NOT fit"))
    if table is None:
        print("no scaling table on --device cpu (it needs a GPU's peak FLOPs)")
        return 0
    print(f"\npredicted data-parallel scaling over {args.network}, {args.gpus_per_node} GPUs per node, micro-batch "
          f"{batch}{'' if 'micro_batch' in given else ' (the largest that fits)'}, from the counted "
          f"{p['params'] / 1e6:.1f} M parameters and {p['flops_per_token']:,.0f} FLOPs/token, compute at {peak}:")
    print_table(scaling_view(table))
    print(SCALING_NOTE)
    return 0
