"""Small torch models for the profiler and executor tests (built from configs, no downloads)."""

from __future__ import annotations

import torch
from torch import nn


class GPTBlock(nn.Module):
    """A hand-written pre-norm GPT block with dropout (attention, residual, MLP)."""

    def __init__(self, d=32, heads=4, p=0.1):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q = q.view(b, s, self.heads, -1).transpose(1, 2)
        k = k.view(b, s, self.heads, -1).transpose(1, 2)
        v = v.view(b, s, self.heads, -1).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / (q.shape[-1] ** 0.5)
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)
        att = self.drop(att.masked_fill(mask, float("-inf")).softmax(-1))
        y = (att @ v).transpose(1, 2).reshape(b, s, d)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x)))))


class TinyGPT(nn.Module):
    def __init__(self, vocab=50, d=32, layers=2, p=0.1):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(GPTBlock(d, 4, p) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class SkipCNN(nn.Module):
    """A small CNN with skip connections and an in-place ReLU."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.conv3 = nn.Conv2d(8, 8, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        h = self.relu(self.bn1(self.conv1(x)))
        h = h + self.conv2(h)
        h = self.relu(h + self.conv3(h))
        return self.fc(self.pool(h).flatten(1))


def mlp():
    torch.manual_seed(0)
    return (
        nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4)),
        torch.randn(8, 16),
        lambda out: out.pow(2).mean(),
    )


def encoder():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
    return (
        nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
        torch.randn(2, 8, 32),
        lambda out: out.pow(2).mean(),
    )


def gpt():
    torch.manual_seed(0)
    return TinyGPT(), torch.randint(0, 50, (2, 8)), lambda out: out.logsumexp(-1).mean()


def cnn():
    torch.manual_seed(0)
    return SkipCNN(), torch.randn(2, 3, 8, 8), lambda out: out.pow(2).mean()


def hf(kind):
    transformers = __import__("transformers")
    torch.manual_seed(0)
    ids = {"input_ids": torch.randint(0, 100, (2, 8))}
    if kind == "gpt2":
        cfg = transformers.GPT2Config(
            n_layer=2,
            n_embd=32,
            n_head=4,
            n_positions=32,
            vocab_size=100,
            bos_token_id=0,
            eos_token_id=0,
        )
        return transformers.GPT2LMHeadModel(cfg), ids, lambda o: o.logits.pow(2).mean()
    if kind == "bert":
        cfg = transformers.BertConfig(
            num_hidden_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            intermediate_size=64,
            vocab_size=100,
            max_position_embeddings=32,
        )
        return transformers.BertModel(cfg), ids, lambda o: o.last_hidden_state.pow(2).mean()
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=100,
        max_position_embeddings=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.LlamaForCausalLM(cfg), ids, lambda o: o.logits.pow(2).mean()


BUILDERS = {
    "mlp": mlp,
    "encoder": encoder,
    "gpt": gpt,
    "cnn": cnn,
    "hf-gpt2": lambda: hf("gpt2"),
    "hf-bert": lambda: hf("bert"),
    "hf-llama": lambda: hf("llama"),
}


def build(name):
    model, inputs, loss_fn = BUILDERS[name]()
    model.train()
    return model, inputs, loss_fn


_PROFILED: dict = {}


def profiled(name):
    """``build(name)`` and its profile (one step), made once per test process."""
    if name not in _PROFILED:
        import slackswap as ss

        model, inputs, loss_fn = build(name)
        # tensor by tensor: these models test the executor's mechanics against the simulator,
        # and the heap's own records of their autograd graphs are as large as their activations
        # (what overhead=True would add to every workspace); parameter gradients held: the
        # mechanics, not the gradients' memory, are under test
        graph = ss.profile(
            model, inputs, loss_fn, warmup=0, repeat=1, overhead=False, gradients="held"
        )
        _PROFILED[name] = (model, inputs, loss_fn, clock_free(graph))
    return _PROFILED[name]


def clock_free(graph):
    """``graph`` with op times set from its bytes instead of the clock (20 us plus the outputs
    at 2 GB/s forward, twice that backward): the plans the tests make of it, and the simulator's
    timeline, are the same on an idle machine and beside busy processes, and a copy on the
    cpu-emulated-link preset (10 GB/s) ends within the op after its issue, as the executor's
    copies on the CPU (done when issued) do."""
    from dataclasses import replace

    ops = []
    for i, op in enumerate(graph.ops):
        out_bytes = int(sum(int(graph.tensor_bytes[t]) for t in graph.op_outputs[i]))
        forward_s = 20e-6 + out_bytes / 2e9
        ops.append(replace(op, forward_s=forward_s, backward_s=2 * forward_s))
    return replace(graph, ops=tuple(ops))
