"""Analytic transformer workloads at kernel granularity, with roofline op times.

The saved tensors follow the per-layer inventory of Korthikanti et al. 2022 (34sbh bytes per layer
with FlashAttention and dropout; 5as^2b more with eager attention). Op time is
max(FLOPs / (eta_c * peak), bytes / (eta_m * HBM)) with the hardware preset's figures.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .core.graph import ActivationGraph, Collective, Op, Tensor
from .core.hardware import Hardware, hardware


@dataclass(frozen=True)
class TransformerConfig:
    """Shape of a transformer training step (s = seq_len, b = micro_batch, h = hidden)."""

    layers: int
    hidden: int
    heads: int
    ffn: int
    seq_len: int
    micro_batch: int
    vocab: int = 0
    kv_heads: int | None = None
    mlp: str = "gelu"
    norm: str = "layernorm"
    attention: str = "flash"
    causal: bool = False
    dropout: float = 0.1
    dtype_bytes: int = 2
    rope: bool = False

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "ffn", "seq_len", "micro_batch", "dtype_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"TransformerConfig: {name} must be a positive integer, got {value!r}"
                )
        if self.vocab < 0:
            raise ValueError(f"TransformerConfig: vocab must be >= 0, got {self.vocab!r}")
        if self.hidden % self.heads:
            raise ValueError(
                f"TransformerConfig: hidden {self.hidden} is not divisible by heads {self.heads}"
            )
        kv = self.kv_heads if self.kv_heads is not None else self.heads
        if kv <= 0 or self.heads % kv:
            raise ValueError(f"TransformerConfig: kv_heads {kv} must divide heads {self.heads}")
        if self.mlp not in ("gelu", "swiglu"):
            raise ValueError(f"TransformerConfig: mlp must be 'gelu' or 'swiglu', got {self.mlp!r}")
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(
                f"TransformerConfig: norm must be 'layernorm' or 'rmsnorm', got {self.norm!r}"
            )
        if self.attention not in ("flash", "eager"):
            raise ValueError(
                f"TransformerConfig: attention must be 'flash' or 'eager', got {self.attention!r}"
            )
        if not 0 <= self.dropout < 1:
            raise ValueError(f"TransformerConfig: dropout must be in [0, 1), got {self.dropout!r}")

    def to_dict(self) -> dict:
        return asdict(self)


WORKLOADS: dict[str, TransformerConfig] = {
    "bert-large": TransformerConfig(
        layers=24,
        hidden=1024,
        heads=16,
        ffn=4096,
        seq_len=512,
        micro_batch=32,
        vocab=0,
        mlp="gelu",
        norm="layernorm",
        causal=False,
        dropout=0.1,
    ),
    "gpt2-xl": TransformerConfig(
        layers=48,
        hidden=1600,
        heads=25,
        ffn=6400,
        seq_len=1024,
        micro_batch=8,
        vocab=50257,
        mlp="gelu",
        norm="layernorm",
        causal=True,
        dropout=0.1,
    ),
    "llama-7b": TransformerConfig(
        layers=32,
        hidden=4096,
        heads=32,
        ffn=11008,
        seq_len=2048,
        micro_batch=4,
        vocab=32000,
        mlp="swiglu",
        norm="rmsnorm",
        causal=True,
        dropout=0.0,
        rope=True,
    ),
}


class _Builder:
    def __init__(self, config: TransformerConfig, hw: Hardware):
        self.c = config
        self.hw = hw
        self.ops: list[Op] = []
        self.tensors: dict[str, list] = {}  # name -> [bytes, saved_for list]

    def tensor(self, name: str, nbytes: int) -> str:
        self.tensors[name] = [int(nbytes), []]
        return name

    def save(self, tensor: str, op: str) -> None:
        self.tensors[tensor][1].append(op)

    def _time(self, flops: float, nbytes: float, eff: float) -> float:
        hw = self.hw
        return max(
            flops / (eff * hw.peak_flops), nbytes / (hw.memory_efficiency * hw.hbm_bytes_per_s)
        )

    def op(
        self,
        name,
        inputs,
        outputs,
        fwd_flops,
        fwd_bytes,
        bwd_flops,
        bwd_bytes,
        kind,
        eff=None,
        saves=(),
    ):
        eff = self.hw.gemm_efficiency if eff is None else eff
        self.ops.append(
            Op(
                name=name,
                forward_s=self._time(fwd_flops, fwd_bytes, eff),
                backward_s=self._time(bwd_flops, bwd_bytes, eff),
                inputs=tuple(inputs),
                outputs=tuple(outputs),
                extra={"kind": kind},
            )
        )
        for t in saves:
            self.save(t, name)

    def gemm(self, name, inp, outs, m, n, k, saves=()):
        d = self.c.dtype_bytes
        flops = 2.0 * m * n * k
        nbytes = d * (m * k + k * n + m * n)
        self.op(name, [inp], outs, flops, nbytes, 2 * flops, 2 * nbytes, "gemm", saves=saves)

    def elementwise(self, name, inputs, outputs, fwd_bytes, bwd_bytes, saves=(), kind="memory"):
        self.op(name, inputs, outputs, 0.0, fwd_bytes, 0.0, bwd_bytes, kind, saves=saves)


def transformer_graph(
    config: TransformerConfig, hw: Hardware | str, name: str | None = None
) -> ActivationGraph:
    """The kernel-level activation graph of one training step of ``config`` on ``hw``."""
    hw = hardware(hw)
    c = config
    B = _Builder(c, hw)
    d = c.dtype_bytes
    s, b, h, f, a = c.seq_len, c.micro_batch, c.hidden, c.ffn, c.heads
    kv = c.kv_heads if c.kv_heads is not None else a
    sbh = s * b * h
    sbh_kv = sbh * kv // a
    sbf = s * b * f
    tokens = s * b
    drop = c.dropout > 0
    x = B.tensor("embed.out", d * sbh)
    B.elementwise("embed", ["tokens"], [x], 2 * d * sbh, 2 * d * sbh)
    for layer in range(c.layers):
        p = f"L{layer}."
        n1 = B.tensor(p + "norm1.out", d * sbh)
        B.elementwise(p + "norm1", [x], [n1], 2 * d * sbh, 3 * d * sbh, saves=[x])
        qkv_out = h + 2 * h * kv // a
        if c.rope:
            q_raw = B.tensor(p + "q_raw", d * sbh)
            k_raw = B.tensor(p + "k_raw", d * sbh_kv)
            v = B.tensor(p + "v", d * sbh_kv)
            B.gemm(p + "qkv", n1, [q_raw, k_raw, v], tokens, qkv_out, h, saves=[n1])
            q = B.tensor(p + "q", d * sbh)
            k = B.tensor(p + "k", d * sbh_kv)
            B.elementwise(
                p + "rope", [q_raw, k_raw], [q, k], 2 * d * (sbh + sbh_kv), 2 * d * (sbh + sbh_kv)
            )
        else:
            q = B.tensor(p + "q", d * sbh)
            k = B.tensor(p + "k", d * sbh_kv)
            v = B.tensor(p + "v", d * sbh_kv)
            B.gemm(p + "qkv", n1, [q, k, v], tokens, qkv_out, h, saves=[n1])
        o = B.tensor(p + "attn.out", d * sbh)
        causal = 0.5 if c.causal else 1.0
        att_flops = 4.0 * b * s * s * h * causal
        if c.attention == "flash":
            lse = B.tensor(p + "attn.lse", 4 * a * s * b)
            io = d * (2 * sbh + 2 * sbh_kv)
            B.op(
                p + "attention",
                [q, k, v],
                [o, lse],
                att_flops,
                io,
                2.5 * att_flops,
                2 * io,
                "attention",
                eff=hw.attention_efficiency,
                saves=[q, k, v, o, lse],
            )
        else:
            ss = a * s * s * b
            scores = B.tensor(p + "attn.scores", d * ss)
            B.op(
                p + "attn.qk",
                [q, k],
                [scores],
                att_flops / 2,
                d * (sbh + sbh_kv + ss),
                att_flops,
                2 * d * (sbh + sbh_kv + ss),
                "gemm",
                saves=[q, k],
            )
            probs = B.tensor(p + "attn.probs", d * ss)
            B.elementwise(p + "attn.softmax", [scores], [probs], 2 * d * ss, 3 * d * ss)
            B.save(probs, p + "attn.softmax")
            pv_in = probs
            if drop:
                amask = B.tensor(p + "attn.mask", ss)
                B.elementwise(p + "attn.mask_gen", [], [amask], ss, 0, kind="rng")
                pd = B.tensor(p + "attn.dropped", d * ss)
                B.elementwise(
                    p + "attn.dropout",
                    [probs, amask],
                    [pd],
                    (2 * d + 1) * ss,
                    (2 * d + 1) * ss,
                    saves=[amask],
                )
                pv_in = pd
            B.op(
                p + "attn.pv",
                [pv_in, v],
                [o],
                att_flops / 2,
                d * (ss + sbh_kv + sbh),
                att_flops,
                2 * d * (ss + sbh_kv + sbh),
                "gemm",
                saves=[pv_in, v],
            )
        attn_proj = B.tensor(p + "attn.proj", d * sbh)
        B.gemm(p + "out_proj", o, [attn_proj], tokens, h, h, saves=[o])
        h1 = B.tensor(p + "h1", d * sbh)
        if drop:
            m1 = B.tensor(p + "drop1.mask", sbh)
            B.elementwise(p + "drop1.mask_gen", [], [m1], sbh, 0, kind="rng")
            B.elementwise(
                p + "add1",
                [attn_proj, m1, x],
                [h1],
                (3 * d + 1) * sbh,
                (3 * d + 1) * sbh,
                saves=[m1],
            )
        else:
            B.elementwise(p + "add1", [attn_proj, x], [h1], 3 * d * sbh, 3 * d * sbh)
        n2 = B.tensor(p + "norm2.out", d * sbh)
        B.elementwise(p + "norm2", [h1], [n2], 2 * d * sbh, 3 * d * sbh, saves=[h1])
        if c.mlp == "gelu":
            g = B.tensor(p + "fc1.out", d * sbf)
            B.gemm(p + "fc1", n2, [g], tokens, f, h, saves=[n2])
            act = B.tensor(p + "gelu.out", d * sbf)
            B.elementwise(p + "gelu", [g], [act], 2 * d * sbf, 3 * d * sbf, saves=[g])
        else:
            gate = B.tensor(p + "gate", d * sbf)
            up = B.tensor(p + "up", d * sbf)
            B.gemm(p + "fc13", n2, [gate, up], tokens, 2 * f, h, saves=[n2])
            act = B.tensor(p + "swiglu.out", d * sbf)
            B.elementwise(
                p + "swiglu", [gate, up], [act], 3 * d * sbf, 5 * d * sbf, saves=[gate, up]
            )
        mlp_out = B.tensor(p + "fc2.out", d * sbh)
        B.gemm(p + "fc2", act, [mlp_out], tokens, h, f, saves=[act])
        x_next = B.tensor(p + "out", d * sbh)
        if drop:
            m2 = B.tensor(p + "drop2.mask", sbh)
            B.elementwise(p + "drop2.mask_gen", [], [m2], sbh, 0, kind="rng")
            B.elementwise(
                p + "add2",
                [mlp_out, m2, h1],
                [x_next],
                (3 * d + 1) * sbh,
                (3 * d + 1) * sbh,
                saves=[m2],
            )
        else:
            B.elementwise(p + "add2", [mlp_out, h1], [x_next], 3 * d * sbh, 3 * d * sbh)
        x = x_next
    nf = B.tensor("final_norm.out", d * sbh)
    B.elementwise("final_norm", [x], [nf], 2 * d * sbh, 3 * d * sbh, saves=[x])
    if c.vocab:
        logits = B.tensor("head.logits", d * tokens * c.vocab)
        B.gemm("head", nf, [logits], tokens, c.vocab, h, saves=[nf])
        loss = B.tensor("loss", 4)
        B.elementwise(
            "loss",
            [logits],
            [loss],
            d * tokens * c.vocab,
            2 * d * tokens * c.vocab,
            saves=[logits],
            kind="loss",
        )
    else:
        loss = B.tensor("loss", 4)
        B.elementwise("loss", [nf], [loss], d * sbh, d * sbh, kind="loss")
    tensors = tuple(Tensor(name=n, bytes=v[0], saved_for=tuple(v[1])) for n, v in B.tensors.items())
    return ActivationGraph(
        name=name or f"transformer-{c.layers}x{c.hidden}",
        ops=tuple(B.ops),
        tensors=tensors,
        optimizer_s=0.0,
        extra={"config": c.to_dict(), "hardware": hw.name},
    )


def layer_parameter_bytes(config: TransformerConfig) -> int:
    """Parameter bytes of one decoder layer at the compute dtype: the QKV and output projections,
    the MLP (two matrices, three with SwiGLU) and two norms."""
    c = config
    kv = c.kv_heads if c.kv_heads is not None else c.heads
    qkv = c.hidden * (c.hidden + 2 * c.hidden * kv // c.heads)
    mlp = (3 if c.mlp == "swiglu" else 2) * c.hidden * c.ffn
    norms = (2 if c.norm == "rmsnorm" else 4) * c.hidden
    return c.dtype_bytes * (qkv + c.hidden * c.hidden + mlp + norms)


def fsdp_collectives(
    config: TransformerConfig, world: int, reshard_after_forward: bool = True
) -> tuple[Collective, ...]:
    """FSDP2's per-rank traffic with one unit per decoder layer and the rest (embedding, final
    norm, head) in the root unit, ``world`` ranks (shared/reference.md): each unit's forward
    all-gather receives (N-1)/N of its parameter bytes, issued as its first op is reached; with
    ``reshard_after_forward`` the backward all-gathers them again, prefetched as the next
    layer's backward starts (the root keeps its parameters: FSDP2 does not reshard it); the
    gradients' reduce-scatter sends (N-1)/N of the same bytes once the unit's backward is done."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 2:
        raise ValueError(f"fsdp_world must be an integer >= 2, got {world!r}")
    c = config
    share = (world - 1) / world
    layer = int(share * layer_parameter_bytes(c))
    root = int(share * c.dtype_bytes * (2 * c.vocab * c.hidden + c.hidden))
    out: list[Collective] = [Collective("root.all_gather", "embed", "forward", 0, root)]
    for i in range(c.layers):
        p = f"L{i}."
        out.append(Collective(p + "all_gather", p + "norm1", "forward", 0, layer))
        if reshard_after_forward:
            at = f"L{i + 1}.add2" if i + 1 < c.layers else p + "add2"
            out.append(Collective(p + "all_gather.backward", at, "backward", 0, layer))
        done = f"L{i - 1}.add2" if i else "embed"
        out.append(Collective(p + "reduce_scatter", done, "backward", layer, 0))
    out.append(Collective("root.reduce_scatter", "embed", "backward", root, 0))
    return tuple(out)


def workload(
    name: str,
    hw: Hardware | str = "a100-80gb-pcie4",
    fsdp_world: int | None = None,
    reshard_after_forward: bool = True,
) -> ActivationGraph:
    """One of the reference workloads ("bert-large", "gpt2-xl", "llama-7b") on ``hw``.

    ``fsdp_world``: the graph of one rank of an FSDP2 job over that many ranks (the same
    activations, plus the job's all-gathers and reduce-scatters; ``fsdp_collectives``). Whether
    they cross the host link is the hardware's ``collectives_on_link``."""
    try:
        config = WORKLOADS[name]
    except KeyError:
        raise ValueError(
            f"unknown workload {name!r}; known: {', '.join(sorted(WORKLOADS))}"
        ) from None
    graph = transformer_graph(config, hw, name=name)
    if fsdp_world is None:
        return graph
    from dataclasses import replace

    return replace(
        graph,
        name=f"{name}-fsdp{fsdp_world}",
        collectives=fsdp_collectives(config, fsdp_world, reshard_after_forward),
        extra={
            **graph.extra,
            "fsdp_world": fsdp_world,
            "reshard_after_forward": reshard_after_forward,
        },
    )
