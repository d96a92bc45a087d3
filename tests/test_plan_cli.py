"""``labkit plan``: a preset, a CONFIG file's run and a user's own model (``--model-module``);
lines for a reader by default, ``--json`` for the raw values, every refusal one line before any
output (labkit/planning.py, labkit/model_module.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from labkit.cli import main


def test_plan_prints_the_planners_numbers(capsys):
    from labkit.study import plan
    from labkit.model import model_config

    assert main(["plan", "--model", "bert-120m", "--gpus", "8", "--micro-batch", "16", "--seq-len", "512"]) == 0
    out = capsys.readouterr().out
    cfg = model_config("bert-120m", plan.STUDY_VOCAB)
    mem = plan.memory_plan(cfg, seq_len=512, micro_batch=16, dp=8)
    best = plan.planned_max_micro_batch(cfg, device="H100 NVL", seq_len=512, precision="bf16", dp=8)
    assert f"{mem['total'] / 1e9:.2f} GB of 94 GB: fits. Largest micro-batch that fits: {best['max_micro_batch']} " in out
    assert f"│ activations     ┆ {mem['activations'] / 1e9:.3f} ┆" in out  # a table in GB, not raw bytes
    assert "splits that fit" in out and "predicted data-parallel scaling" in out and "efficiency" in out
    assert max(map(len, out.splitlines())) <= 140 and "shape:" not in out  # readable in a terminal
    assert main(["plan", "--model", "bert-120m", "--gpus", "8", "--micro-batch", "16", "--json"]) == 0
    raw = json.loads(capsys.readouterr().out)
    assert raw["memory"]["total"] == mem["total"] and raw["max_micro_batch"] == best["max_micro_batch"]


def test_plan_counts_a_model_defined_in_a_users_file(tmp_path, capsys):
    """A model labkit did not write, from a file: its max micro-batch and the terms behind it,
    the same numbers plan_model gives; a bad FILE:FACTORY is one line and exit 2."""
    from labkit.study.memory import plan_model

    user = tmp_path / "my_model.py"
    user.write_text("from plain_encoder import factory as plain\n"
                    "def factory(seq_len):\n"
                    "    return plain(seq_len=seq_len, vocab=300, hidden=32, layers=1, heads=2, ffn=64)\n")
    args = ["plan", "--model-module", f"{user}:factory", "--seq-len", "32", "--precision", "fp32", "--device", "cpu",
            "--budget-gb", "0.05"]
    assert main(args) == 0
    out = capsys.readouterr().out
    import sys
    import pathlib

    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from plain_encoder import factory

    p = plan_model(*factory(seq_len=32, vocab=300, hidden=32, layers=1, heads=2, ffn=64), device="cpu",
                   precision="fp32", budget_bytes=int(0.05e9))
    assert f"max micro-batch: {p['max_micro_batch']} (verified by counting" in out
    assert f"{p['activation_bytes_per_sequence']:,}" in out and "state: adamw state" in out
    assert "CPU: the budget counts tensor bytes; a training process's RSS ran 1.19-1.41x" in out  # measure.CPU_RSS_OVERHEAD
    assert main(["plan", "--model-module", f"{user}:nope", "--device", "cpu", "--budget-gb", "1"]) == 2
    assert "has no function 'nope'" in capsys.readouterr().err
    assert main(["plan", "--model-module", str(user), "--device", "cpu", "--budget-gb", "1"]) == 2
    assert "FILE.py:FACTORY" in capsys.readouterr().err


def test_plan_of_a_users_model_prints_json_with_its_scaling_table():
    """`labkit plan --model-module tests/plain_encoder.py:factory --gpus 64 --network IB-NDR --json`
    (issue 31): one JSON object; its scaling table is the presets' path (study.scaling.model_scaling,
    which study_scaling also takes) fed the counted parameters and FLOPs, and the parameters are
    the model's own."""
    import pathlib

    import polars as pl

    from labkit.study import plan, scaling

    root = pathlib.Path(__file__).parents[1]
    proc = subprocess.run([sys.executable, "-m", "labkit.cli", "plan", "--model-module", "tests/plain_encoder.py:factory",
                           "--gpus", "64", "--network", "IB-NDR", "--json"], capture_output=True, text=True, cwd=root,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    raw = json.loads(proc.stdout)
    p = raw["plan"]
    sys.path.insert(0, str(root / "tests"))
    from plain_encoder import factory

    model = factory(seq_len=512)[0]()
    assert p["params"] == sum(t.numel() for t in model.parameters())
    assert p["params_before_blocks"] == model.tok.weight.numel() + model.pos.weight.numel()
    assert p["device"] == "H100 NVL" and p["dp"] == 64 and p["seq_len"] == 512
    b = raw["at_micro_batch"]["micro_batch"]
    assert b == p["max_micro_batch"] > 0 and raw["at_micro_batch"]["fits"]
    table = pl.DataFrame(raw["scaling"])
    assert table["n_gpus"].to_list() == [1, 2, 4, 8, 16, 32, 64]
    want = scaling.efficiency_table(
        compute_s=512 * b * p["flops_per_token"] / (0.4 * plan.device_info("H100 NVL")["peak_flops"]),
        grad_bytes=4 * p["params"], tokens_per_step=512 * b, gpus=(1, 2, 4, 8, 16, 32, 64), network="IB-NDR",
        gpus_per_node=2, last_bucket_bytes=max(4 * p["params_before_blocks"], min(scaling.BUCKET_BYTES, 4 * p["params"])))
    for col in ("compute_s", "comm_s", "exposed_s", "step_s", "efficiency"):
        assert table[col].to_list() == pytest.approx(want[col].to_list(), rel=1e-12), col
    assert raw["scaling_inputs"]["network"] == "IB-NDR"


def test_model_scaling_is_the_presets_path():
    """study_scaling of a preset is model_scaling fed that preset's formula parameters and FLOPs."""
    from labkit.model import count_parameters, flops_per_token, model_config
    from labkit.study import plan, scaling

    cfg = model_config("bert-120m", plan.STUDY_VOCAB, max_position_embeddings=512)
    kw = {"micro_batch": 16, "seq_len": 512, "network": "IB-NDR", "gpus": (1, 8, 64), "gpus_per_node": 4}
    preset = scaling.study_scaling("bert-120m", **kw)
    h = cfg.hidden_size
    embeddings = (cfg.vocab_size + cfg.type_vocab_size + cfg.max_position_embeddings) * h + 2 * h
    counted = scaling.model_scaling(params=count_parameters(cfg)["total"], flops_per_token=flops_per_token(cfg, 512),
                                    params_ready_last=embeddings, **kw)
    assert preset.equals(counted)


def test_plan_of_a_users_model_honours_or_refuses_every_flag(tmp_path, capsys):
    """With --model-module: --micro-batch sets the scaling table's micro-batch and is checked
    against the memory; --top, --model, --gpus on a CPU, --vocab-size for a factory without a
    vocab_size parameter and a factory without seq_len are one line and exit 2."""
    user = tmp_path / "my_model.py"
    user.write_text("from plain_encoder import factory as plain\n"
                    "def factory(seq_len):\n"
                    "    return plain(seq_len=seq_len, vocab=300, hidden=32, layers=1, heads=2, ffn=64)\n"
                    "def sized(seq_len, vocab_size):\n"
                    "    return plain(seq_len=seq_len, vocab=vocab_size, hidden=32, layers=1, heads=2, ffn=64)\n"
                    "def no_seq_len():\n"
                    "    return plain(vocab=300, hidden=32, layers=1, heads=2, ffn=64)\n")
    small = ["--seq-len", "32", "--precision", "fp32"]
    assert main(["plan", "--model-module", f"{user}:factory", *small, "--gpus", "8", "--gpus-per-node", "4",
                 "--network", "100GbE", "--micro-batch", "7"]) == 0
    out = capsys.readouterr().out
    assert "at micro-batch 7: " in out and "fits" in out
    assert "predicted data-parallel scaling over 100GbE, 4 GPUs per node, micro-batch 7," in out
    assert "│ 8      ┆ 2     ┆" in out  # 8 GPUs on 2 nodes
    assert "not modelled: the CUDA context, cuBLAS workspaces, NCCL buffers" in out  # the count's limits, stated
    assert main(["plan", "--model-module", f"{user}:sized", *small, "--vocab-size", "123", "--json"]) == 0
    raw = json.loads(capsys.readouterr().out)
    heads, attn_out, ffn, norms = 2 * 3 * (32 * 16 + 16), 32 * 32 + 32, 32 * 64 + 64 + 64 * 32 + 32, 3 * 2 * 32
    tok, pos, decoder = 123 * 32, 512 * 32, 32 * 123 + 123  # vocab_size=123 reached the model; untied decoder
    assert raw["plan"]["params"] == heads + attn_out + ffn + norms + tok + pos + decoder
    assert raw["plan"]["params_before_blocks"] == tok + pos and len(raw["scaling"]) == 9  # 1..256 GPUs
    for args, err in (([f"{user}:factory", "--top", "3"], "--top: does not apply with --model-module"),
                      ([f"{user}:factory", "--model", "bert-120m"], "--model: does not apply"),
                      ([f"{user}:factory", "--device", "cpu", "--budget-gb", "1", "--gpus", "8"],
                       "--gpus: does not apply with --model-module (the scaling table needs a GPU's peak FLOPs"),
                      ([f"{user}:factory", "--vocab-size", "99"], "--vocab-size: factory(seq_len) has no vocab_size"),
                      ([f"{user}:no_seq_len"], "model_module: no_seq_len() cannot be called as no_seq_len(seq_len=32)")):
        assert main(["plan", "--model-module", *args, "--seq-len", "32"]) == 2
        got = capsys.readouterr().err
        assert err in got and len(got.strip().splitlines()) == 1, got


def test_plan_raises_no_deprecation_warning():
    """The planner (preset and counted model) under -W error for DeprecationWarning and
    FutureWarning: torch.distributed.optim's import-time torch.jit.script warnings are filtered
    where labkit imports it (labkit/train/dist.py, optim.py), and nothing else warns."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    flags = [sys.executable, "-W", "error::DeprecationWarning", "-W", "error::FutureWarning", "-m", "labkit.cli", "plan"]
    for args in (["configs/walkthrough.toml", "--vocab-size", "1024"],
                 ["--model-module", "tests/plain_encoder.py:factory", "--seq-len", "32"]):
        proc = subprocess.run(flags + args, cwd=root, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0 and "Warning" not in proc.stderr, (args, proc.stderr[-2000:])


FACTORIES = '''
import torch
from torch import nn


class Tiny(nn.Module):
    def __init__(self, returns="loss"):
        super().__init__()
        self.returns = returns
        self.emb, self.out = nn.Embedding(50, 8), nn.Linear(8, 50)

    def forward(self, input_ids):
        logits = self.out(self.emb(input_ids))
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), input_ids.flatten())
        return {"dict": {"loss": loss}, "vector": logits.mean(-1), "loss": loss}[self.returns]


def ids(seq_len):
    return lambda b: {"input_ids": torch.randint(0, 50, (b, seq_len))}


def dict_loss(seq_len):
    return (lambda: Tiny("dict")), ids(seq_len)


def vector_loss(seq_len):
    return (lambda: Tiny("vector")), ids(seq_len)


def not_a_module(seq_len):
    return (lambda: "a model"), ids(seq_len)


def batch_not_a_dict(seq_len):
    return Tiny, (lambda b: torch.zeros(b, seq_len, dtype=torch.long))


def float_ids(seq_len):
    return Tiny, (lambda b: {"input_ids": torch.zeros(b, seq_len)})


def raises(seq_len):
    raise KeyError("no such layer")


def one_callable(seq_len):
    return Tiny


def copied_layers(seq_len):  # nn.TransformerEncoder deep-copies its layer: torch read a FakeTensor's data_ptr
    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.out = nn.Embedding(50, 16), nn.Linear(16, 50)
            self.blocks = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2)

        def forward(self, input_ids):
            x = self.blocks(self.emb(input_ids))
            return nn.functional.cross_entropy(self.out(x).flatten(0, 1), input_ids.flatten())

    return Encoder, ids(seq_len)
'''


def test_every_factory_mistake_is_one_line_naming_it_and_the_contract(tmp_path, capsys):
    """A loss that is a dict or not a scalar, a model that is not an nn.Module, a batch that is no
    dict or holds no int64 ids, a factory that raises or returns one callable: one line naming
    what was wrong (and, for the contract's terms, what the contract wants), exit 2. They were
    tracebacks with exit 1 (TypeError, AttributeError, KeyError)."""
    user = tmp_path / "factories.py"
    user.write_text(FACTORIES)
    cpu = ["--device", "cpu", "--budget-gb", "0.05", "--seq-len", "8", "--precision", "fp32"]
    for name, said in (("dict_loss", "forward: returned a dict with keys ['loss'], not a loss tensor"),
                       ("vector_loss", "forward: the loss must be a scalar, got a tensor of shape (2, 8)"),
                       ("not_a_module", "make_model() returned a str, not a torch.nn.Module"),
                       ("batch_not_a_dict", "make_batch(2) returned a Tensor, not a dict of keyword arguments"),
                       ("float_ids", "make_batch(2) holds no int64 tensor [2, seq_len] of input ids (got "
                                     "{'input_ids': 'float32 [2, 8]'})"),
                       ("raises", "model_module: raises(seq_len=8) raised KeyError: 'no such layer'"),
                       ("one_callable", "model_module: one_callable(seq_len=8) returned a type, not two callables")):
        assert main(["plan", "--model-module", f"{user}:{name}", *cpu]) == 2, name
        cap = capsys.readouterr()
        assert len(cap.err.strip().splitlines()) == 1 and said in cap.err and cap.out == "", (name, cap.err)
        assert "the contract" in cap.err or name == "raises", (name, cap.err)


def test_counting_a_model_built_by_deepcopy_prints_no_fake_tensor_warning(tmp_path, capsys):
    """nn.TransformerEncoder deep-copies its layer, and under fake tensors torch's
    Tensor.__deepcopy__ reads data_ptr() and warned "This is almost definitely a bug in your code"
    about labkit's own counting. The count is the same; the warning is gone."""
    import warnings

    user = tmp_path / "factories.py"
    user.write_text(FACTORIES)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert main(["plan", "--model-module", f"{user}:copied_layers", "--device", "cpu", "--budget-gb", "0.005",
                     "--seq-len", "8", "--precision", "fp32"]) == 0
    assert "counted on fake tensors" in capsys.readouterr().out
    assert not [w for w in seen if "FakeTensor" in str(w.message)], [str(w.message)[:80] for w in seen]


def test_every_refusal_comes_before_any_output(capsys):
    """An unknown network, or a precision without a peak on the device, is refused in one line with
    nothing printed before it, for a preset, a CONFIG and a user's model (the CONFIG's refusal came
    after its memory table)."""
    for args in (["--network", "bogus"], ["configs/study.toml", "--network", "bogus"],
                 ["--model-module", "tests/plain_encoder.py:factory", "--network", "bogus"],
                 ["--precision", "fp32", "--device", "A100 80GB"],
                 ["--model-module", "tests/plain_encoder.py:factory", "--precision", "fp32", "--device", "H200"]):
        assert main(["plan", *args]) == 2, args
        cap = capsys.readouterr()
        assert cap.out == "" and len(cap.err.strip().splitlines()) == 1, (args, cap)
        assert "network: unknown 'bogus'" in cap.err or "no 'fp32' peak" in cap.err, cap.err


def test_fp32_and_bf16_scaling_tables_each_at_its_own_peak(capsys):
    """`labkit plan --precision fp32` scaled at the bf16 peak (compute_s 0.0479 s for bert-350m either
    way): now each table is computed at its precision's peak and says which."""
    tables = {}
    for precision, peak in (("fp32", "(60 TFLOP/s)"), ("bf16", "(835.5 TFLOP/s)")):
        args = ["plan", "--model", "bert-350m", "--gpus", "8", "--precision", precision]
        assert main(args) == 0
        out = capsys.readouterr().out
        assert f"compute at 40% MFU of the H100 NVL's dense {precision} peak {peak}:" in out
        assert main([*args, "--json"]) == 0
        raw = json.loads(capsys.readouterr().out)
        assert raw["scaling_inputs"]["precision"] == precision
        tables[precision] = raw["scaling"]
    assert tables["fp32"][0]["compute_s"] / tables["bf16"][0]["compute_s"] == pytest.approx(835.5 / 60)
    assert [r["efficiency"] for r in tables["fp32"]] != [r["efficiency"] for r in tables["bf16"]]
