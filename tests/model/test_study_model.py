"""The study's model as labkit options (configs/study.toml's model_overrides), against a
one-process reference: a transcription of the authors' model (undertale-re/undertale at be7ec98,
undertale/models/item/model.py, MIT licence; Lightning left out) with the same weights copied in.
Also: each option alone against labkit's default path, the HF export of the options BERT can
express (against transformers' BertForMaskedLM), and the one-line refusal of the others."""

from __future__ import annotations

import dataclasses
from math import sqrt

import pytest
import torch
from torch import nn

from labkit.config.tomlfile import load
from labkit.model import BertMLM, count_parameters, export_hf, model_config
from labkit.model.attention import instruction_positions

NEXT_ID = 5


# --- the authors' model, transcribed (their names) --------------------------------------------

class Attention(nn.Module):
    def __init__(self, hidden: int, head: int):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(hidden, head), nn.Linear(hidden, head), nn.Linear(hidden, head)

    def forward(self, state, mask=None):
        query, key, value = self.q(state), self.k(state), self.v(state)
        scores = torch.bmm(query, key.transpose(-2, -1)) / sqrt(query.size(-1))
        if mask is not None:
            scores = scores.masked_fill(mask.unsqueeze(-2) == 0, -1e9)
        return torch.bmm(torch.softmax(scores, dim=-1), value)


class Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, intermediate: int, dropout: float):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)  # torch's eps 1e-5
        self.heads = nn.ModuleList(Attention(hidden, hidden // heads) for _ in range(heads))
        self.output = nn.Linear(hidden, hidden)
        self.linear1, self.linear2 = nn.Linear(hidden, intermediate), nn.Linear(intermediate, hidden)
        self.dropout = nn.Dropout(dropout)

    def forward(self, state, mask=None):
        hidden = self.norm1(state)
        output = state + self.output(torch.cat([h(hidden, mask) for h in self.heads], dim=-1))
        hidden = self.norm2(output)
        return output + self.dropout(self.linear2(nn.functional.gelu(self.linear1(hidden))))


class AuthorsModel(nn.Module):
    def __init__(self, depth, hidden, vocab, input_size, heads, intermediate, dropout, eps):
        super().__init__()
        self.token, self.instruction = nn.Embedding(vocab, hidden), nn.Embedding(input_size, hidden)
        self.argument = nn.Embedding(input_size, hidden)
        self.norm, self.dropout = nn.LayerNorm(hidden, eps=eps), nn.Dropout(dropout)
        self.layers = nn.ModuleList(Layer(hidden, heads, intermediate, dropout) for _ in range(depth))
        self.transform, self.head_norm = nn.Linear(hidden, hidden), nn.LayerNorm(hidden, eps=eps)
        self.decode = nn.Linear(hidden, vocab)

    def forward(self, state, mask=None):
        starts = torch.roll(state == NEXT_ID, 1)
        starts[:, 0] = False
        instructions = torch.cumsum(starts, dim=-1)
        arguments = torch.zeros(instructions.shape, dtype=torch.long)
        for i, batch in enumerate(instructions):
            arguments[i] = torch.cat([torch.arange(v) for v in torch.bincount(batch)])
        x = self.dropout(self.norm(self.token(state) + self.instruction(instructions) + self.argument(arguments)))
        for layer in self.layers:
            x = layer(x, mask)
        return self.decode(self.head_norm(nn.functional.gelu(self.transform(x))))


def copy_weights(ours: BertMLM, theirs: AuthorsModel) -> None:
    """Our weights into theirs: the fused QKV rows are [all queries; all keys; all values], head j
    at rows j*Q..(j+1)*Q of each third."""
    cfg, q = ours.cfg, ours.cfg.head_dim
    pairs = [(ours.word, theirs.token), (ours.instruction, theirs.instruction), (ours.argument, theirs.argument),
             (ours.embed_norm, theirs.norm), (ours.head_dense, theirs.transform), (ours.head_norm, theirs.head_norm)]
    with torch.no_grad():
        for a, b in pairs:
            for name, p in a.named_parameters():
                getattr(b, name).copy_(p)
        theirs.decode.weight.copy_(ours.decoder)
        theirs.decode.bias.copy_(ours.decoder_bias)
        for mine, layer in zip(ours.layers, theirs.layers):
            for a, b in [(mine.attn_norm, layer.norm1), (mine.ffn_norm, layer.norm2), (mine.attn_out, layer.output),
                         (mine.ffn_in, layer.linear1), (mine.ffn_out, layer.linear2)]:
                b.weight.copy_(a.weight)
                b.bias.copy_(a.bias)
            w = mine.qkv.weight.view(3, cfg.num_heads, q, cfg.hidden_size)
            bias = mine.qkv.bias.view(3, cfg.num_heads, q)
            for j, head in enumerate(layer.heads):
                for k, lin in enumerate((head.q, head.k, head.v)):
                    lin.weight.copy_(w[k, j])
                    lin.bias.copy_(bias[k, j])


def study_cfg(vocab_size: int = 97, **overrides):
    """configs/study.toml's model options on a small shape."""
    lab = load("configs/study.toml")
    opts = {**lab.train.model_overrides, "max_position_embeddings": 64, **overrides}
    return model_config("tiny", vocab_size, **opts)


def batch(cfg, b: int = 3, t: int = 40, seed: int = 0):
    """Ids with [NEXT] between instructions of 1-6 tokens, rows padded to different lengths."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, cfg.vocab_size, (b, t), generator=g)
    ids[torch.rand(b, t, generator=g) < 0.25] = NEXT_ID
    mask = torch.ones(b, t, dtype=torch.bool)
    for row, n in enumerate((t, t - 7, t - 19)[:b]):
        ids[row, n:], mask[row, n:] = 0, False
    labels = torch.where(torch.rand(b, t, generator=g) < 0.3, ids, -100).masked_fill(~mask, -100)
    return ids, mask, labels


def pair(cfg):
    torch.manual_seed(0)
    ours = BertMLM(cfg)
    theirs = AuthorsModel(cfg.num_layers, cfg.hidden_size, cfg.vocab_size, cfg.max_position_embeddings,
                          cfg.num_heads, cfg.ffn_size, cfg.hidden_dropout, cfg.norm_eps)
    copy_weights(ours, theirs)
    return ours, theirs


def test_instruction_positions_equal_the_authors_loop():
    ids, _, _ = batch(model_config("tiny", 97), b=3, t=40)
    instruction, argument = instruction_positions(ids, NEXT_ID)
    starts = torch.roll(ids == NEXT_ID, 1)
    starts[:, 0] = False
    assert torch.equal(instruction, torch.cumsum(starts, dim=-1))
    assert torch.equal(argument, torch.stack([torch.cat([torch.arange(v) for v in torch.bincount(r)])
                                              for r in instruction]))


def test_the_study_model_equals_the_authors_forward_and_backward():
    cfg = study_cfg()
    ours, theirs = pair(cfg)
    ids, mask, labels = batch(cfg)
    ours.eval(), theirs.eval()
    logits = theirs(ids, mask)
    out = ours(ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(out.logits, logits, rtol=1e-5, atol=1e-5)
    ref = nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), labels.reshape(-1), reduction="sum")
    torch.testing.assert_close(out.loss_sum, ref, rtol=1e-5, atol=1e-5)
    out.loss_sum.backward()
    ref.backward()
    torch.testing.assert_close(ours.decoder.grad, theirs.decode.weight.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(ours.instruction.weight.grad, theirs.instruction.weight.grad, rtol=1e-4, atol=1e-6)
    q = ours.layers[0].qkv.weight.grad.view(3, cfg.num_heads, cfg.head_dim, -1)
    torch.testing.assert_close(q[1, 1], theirs.layers[0].heads[1].k.weight.grad, rtol=1e-4, atol=1e-6)


def test_train_mode_dropout_falls_where_the_authors_does():
    """Dropout 0.1 in train mode, the same seed: the same outputs, so dropout acts on the
    embeddings and the FFN outputs only, in the same order (attention_output_dropout False)."""
    cfg = study_cfg(hidden_dropout=0.1)
    ours, theirs = pair(cfg)
    ids, mask, labels = batch(cfg)
    torch.manual_seed(7)
    logits = theirs(ids, mask)
    torch.manual_seed(7)
    torch.testing.assert_close(ours(ids, attention_mask=mask, labels=labels).logits, logits, rtol=1e-5, atol=1e-5)
    torch.manual_seed(7)
    bert_dropout = BertMLM(dataclasses.replace(cfg, attention_output_dropout=True))
    bert_dropout.load_state_dict(ours.state_dict())
    torch.manual_seed(7)
    assert not torch.allclose(bert_dropout(ids, attention_mask=mask, labels=labels).logits, logits, atol=1e-3)


@pytest.mark.parametrize("sparse", [False, True])
def test_eager_attention_equals_sdpa(sparse):
    cfg = model_config("tiny", 97, attention_dropout=0.0, sparse_head=sparse)
    torch.manual_seed(0)
    sdpa = BertMLM(cfg).eval()
    eager = BertMLM(dataclasses.replace(cfg, attention_backend="eager")).eval()
    eager.load_state_dict(sdpa.state_dict())
    ids, mask, labels = batch(cfg)
    a, b = sdpa(ids, attention_mask=mask, labels=labels), eager(ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(b.logits, a.logits, rtol=1e-5, atol=1e-5)
    a.loss_sum.backward(), b.loss_sum.backward()
    torch.testing.assert_close(eager.layers[0].qkv.weight.grad, sdpa.layers[0].qkv.weight.grad, rtol=1e-4, atol=1e-6)


def test_eager_attention_keeps_the_probabilities():
    """Saved tensors (autograd's pack hook), rows without padding: eager keeps a [B, nh, T, T]
    tensor per layer; SDPA's fused CPU kernel (taken without a mask or dropout) keeps none."""
    cfg = model_config("tiny", 97, attention_dropout=0.0, hidden_dropout=0.0, sparse_head=False)
    ids, mask, labels = batch(cfg, b=1, t=40)
    ids, mask, labels = ids.repeat(2, 1), mask.repeat(2, 1), labels.repeat(2, 1)  # row 0: no padding
    sizes = {}
    for backend in ("sdpa", "eager"):
        model = BertMLM(dataclasses.replace(cfg, attention_backend=backend)).train()
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
            model(ids, attention_mask=mask, labels=labels)
        sizes[backend] = shapes.count((2, cfg.num_heads, 40, 40))  # T 40, head_dim 32
    assert sizes["sdpa"] == 0 and sizes["eager"] >= cfg.num_layers


def test_options_one_by_one():
    cfg = model_config("tiny", 97)
    ids, mask, labels = batch(cfg)
    for field, value in [("type_vocab_size", 0), ("final_norm", False), ("block_norm_eps", 1e-5)]:
        extra = {"norm_position": "pre"} if field == "final_norm" else {}
        model = BertMLM(dataclasses.replace(cfg, **extra, **{field: value}))
        assert torch.isfinite(model(ids, attention_mask=mask, labels=labels).loss_sum)
    assert BertMLM(dataclasses.replace(cfg, type_vocab_size=0)).token_type is None
    assert BertMLM(dataclasses.replace(cfg, norm_position="pre", final_norm=False)).final_norm is None
    assert BertMLM(dataclasses.replace(cfg, block_norm_eps=1e-5)).layers[0].attn_norm.eps == 1e-5
    with pytest.raises(ValueError, match="final_norm"):
        model_config("tiny", 97, final_norm=False)
    with pytest.raises(ValueError, match="attention_backend"):
        model_config("tiny", 97, attention="linear", attention_backend="eager")


def test_parameter_count_of_the_study_model():
    """docs/references.md A2: 86,434,560 + 1,537 V for the 120M shape; the closed form equals the
    model's own count."""
    lab = load("configs/study.toml")
    cfg = model_config(lab.train.model, 5000, **lab.train.model_overrides)
    counts = count_parameters(cfg)
    assert counts["total"] == 86_434_560 + 1537 * 5000
    small = study_cfg()
    assert count_parameters(BertMLM(small)) == count_parameters(small)


def test_hf_export_of_the_bert_expressible_options(tmp_path):
    """Untied decoder at every position, eager attention without dropout and no token-type table:
    BertForMaskedLM loads the export and gives the same logits."""
    from transformers import BertForMaskedLM

    cfg = model_config("tiny", 97, tie_embeddings=False, sparse_head=False, attention_backend="eager",
                       attention_dropout=0.0, type_vocab_size=0)
    torch.manual_seed(0)
    model = BertMLM(cfg).eval()
    export_hf(model, tmp_path)
    hf = BertForMaskedLM.from_pretrained(tmp_path).eval()
    ids, mask, _ = batch(cfg)
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids, attention_mask=mask).logits,
                                   model(ids, attention_mask=mask).logits, rtol=1e-5, atol=1e-5)


def test_hf_export_refuses_the_study_model_in_one_line(tmp_path):
    model = BertMLM(study_cfg())
    with pytest.raises(ValueError) as err:
        export_hf(model, tmp_path)
    assert "\n" not in str(err.value) and str(err.value).startswith("norm_position: BertForMaskedLM interop")
    for field, value in [("position_embedding", "instruction"), ("attention_output_dropout", False),
                         ("block_norm_eps", 1e-5)]:
        with pytest.raises(ValueError, match=f"^{field}: BertForMaskedLM interop"):
            export_hf(BertMLM(model_config("tiny", 97, **{field: value})), tmp_path)
