"""Analytic transformer workloads at kernel granularity, with roofline op times.

The saved tensors follow the per-layer inventory of Korthikanti et al. 2022 (34sbh bytes per layer
with FlashAttention and dropout; 5as^2b more with eager attention). Op time is
max(FLOPs / (eta_c * peak), bytes / (eta_m * HBM)) with the hardware preset's figures.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from .core.graph import ActivationGraph, Collective, Op, Tensor
from .core.hardware import Hardware, hardware
from .core.stages import pipeline_messages


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

    def graph(self, name: str, extra: dict) -> ActivationGraph:
        """The ops and tensors built so far as a graph (its config and hardware in ``extra``)."""
        tensors = tuple(
            Tensor(name=n, bytes=v[0], saved_for=tuple(v[1])) for n, v in self.tensors.items()
        )
        return ActivationGraph(
            name=name,
            ops=tuple(self.ops),
            tensors=tensors,
            optimizer_s=0.0,
            extra={"config": self.c.to_dict(), "hardware": self.hw.name, **extra},
        )

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

    def op(self, name, inputs, outputs, forward, backward, kind, *, eff=None, saves=()):
        """An op whose forward and backward each move ``(flops, bytes)``: its time is the
        roofline's at ``eff`` (default the GEMM efficiency)."""
        eff = self.hw.gemm_efficiency if eff is None else eff
        self.ops.append(
            Op(
                name=name,
                forward_s=self._time(*forward, eff),
                backward_s=self._time(*backward, eff),
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
        self.op(name, [inp], outs, (flops, nbytes), (2 * flops, 2 * nbytes), "gemm", saves=saves)

    def elementwise(self, name, inputs, outputs, fwd_bytes, bwd_bytes, saves=(), kind="memory"):
        self.op(name, inputs, outputs, (0.0, fwd_bytes), (0.0, bwd_bytes), kind, saves=saves)

    # the sizes one layer's tensors are made of
    @property
    def sbh(self) -> int:
        return self.c.seq_len * self.c.micro_batch * self.c.hidden

    @property
    def sbh_kv(self) -> int:
        c = self.c
        kv = c.kv_heads if c.kv_heads is not None else c.heads
        return self.sbh * kv // c.heads

    @property
    def sbf(self) -> int:
        return self.c.seq_len * self.c.micro_batch * self.c.ffn

    @property
    def tokens(self) -> int:
        return self.c.seq_len * self.c.micro_batch

    def residual_add(self, name, inputs, out):
        """``out = sum(inputs)``, through dropout on the first input when the config has it
        (a mask drawn by an RNG op, saved for backward)."""
        d, sbh = self.c.dtype_bytes, self.sbh
        if self.c.dropout > 0:
            mask = self.tensor(name.replace("add", "drop") + ".mask", sbh)
            self.elementwise(
                name.replace("add", "drop") + ".mask_gen", [], [mask], sbh, 0, kind="rng"
            )
            traffic = (3 * d + 1) * sbh
            self.elementwise(
                name, [inputs[0], mask, *inputs[1:]], [out], traffic, traffic, saves=[mask]
            )
        else:
            self.elementwise(name, inputs, [out], 3 * d * sbh, 3 * d * sbh)

    def qkv(self, p: str, n1: str) -> tuple[str, str, str]:
        """The query, key and value projections (with rotary embeddings when the config has
        them)."""
        c, d, sbh, sbh_kv = self.c, self.c.dtype_bytes, self.sbh, self.sbh_kv
        kv = c.kv_heads if c.kv_heads is not None else c.heads
        qkv_out = c.hidden + 2 * c.hidden * kv // c.heads
        if c.rope:
            q_raw = self.tensor(p + "q_raw", d * sbh)
            k_raw = self.tensor(p + "k_raw", d * sbh_kv)
            v = self.tensor(p + "v", d * sbh_kv)
            self.gemm(p + "qkv", n1, [q_raw, k_raw, v], self.tokens, qkv_out, c.hidden, saves=[n1])
            q = self.tensor(p + "q", d * sbh)
            k = self.tensor(p + "k", d * sbh_kv)
            traffic = 2 * d * (sbh + sbh_kv)
            self.elementwise(p + "rope", [q_raw, k_raw], [q, k], traffic, traffic)
        else:
            q = self.tensor(p + "q", d * sbh)
            k = self.tensor(p + "k", d * sbh_kv)
            v = self.tensor(p + "v", d * sbh_kv)
            self.gemm(p + "qkv", n1, [q, k, v], self.tokens, qkv_out, c.hidden, saves=[n1])
        return q, k, v

    def attention(self, p: str, q: str, k: str, v: str) -> str:
        """Attention's core: one fused kernel (flash), or scores, softmax, dropout and the
        product with the values as separate ops."""
        c, d, sbh, sbh_kv = self.c, self.c.dtype_bytes, self.sbh, self.sbh_kv
        b, s, a = c.micro_batch, c.seq_len, c.heads
        o = self.tensor(p + "attn.out", d * sbh)
        att_flops = 4.0 * b * s * s * c.hidden * (0.5 if c.causal else 1.0)
        if c.attention == "flash":
            lse = self.tensor(p + "attn.lse", 4 * a * s * b)
            io = d * (2 * sbh + 2 * sbh_kv)
            self.op(
                p + "attention",
                [q, k, v],
                [o, lse],
                (att_flops, io),
                (2.5 * att_flops, 2 * io),
                "attention",
                eff=self.hw.attention_efficiency,
                saves=[q, k, v, o, lse],
            )
            return o
        ss = a * s * s * b
        scores = self.tensor(p + "attn.scores", d * ss)
        traffic = d * (sbh + sbh_kv + ss)
        qk = (att_flops / 2, traffic), (att_flops, 2 * traffic)
        self.op(p + "attn.qk", [q, k], [scores], *qk, "gemm", saves=[q, k])
        probs = self.tensor(p + "attn.probs", d * ss)
        self.elementwise(p + "attn.softmax", [scores], [probs], 2 * d * ss, 3 * d * ss)
        self.save(probs, p + "attn.softmax")
        pv_in = probs
        if c.dropout > 0:
            amask = self.tensor(p + "attn.mask", ss)
            self.elementwise(p + "attn.mask_gen", [], [amask], ss, 0, kind="rng")
            pd = self.tensor(p + "attn.dropped", d * ss)
            traffic_drop = (2 * d + 1) * ss
            self.elementwise(
                p + "attn.dropout", [probs, amask], [pd], traffic_drop, traffic_drop, saves=[amask]
            )
            pv_in = pd
        traffic = d * (ss + sbh_kv + sbh)
        pv = (att_flops / 2, traffic), (att_flops, 2 * traffic)
        self.op(p + "attn.pv", [pv_in, v], [o], *pv, "gemm", saves=[pv_in, v])
        return o

    def mlp(self, p: str, n2: str) -> str:
        """The MLP: GELU over one matrix, or SwiGLU over a fused gate and up projection; then the
        down projection."""
        c, d, sbf, h, f = self.c, self.c.dtype_bytes, self.sbf, self.c.hidden, self.c.ffn
        if c.mlp == "gelu":
            g = self.tensor(p + "fc1.out", d * sbf)
            self.gemm(p + "fc1", n2, [g], self.tokens, f, h, saves=[n2])
            act = self.tensor(p + "gelu.out", d * sbf)
            self.elementwise(p + "gelu", [g], [act], 2 * d * sbf, 3 * d * sbf, saves=[g])
        else:
            gate = self.tensor(p + "gate", d * sbf)
            up = self.tensor(p + "up", d * sbf)
            self.gemm(p + "fc13", n2, [gate, up], self.tokens, 2 * f, h, saves=[n2])
            act = self.tensor(p + "swiglu.out", d * sbf)
            self.elementwise(
                p + "swiglu", [gate, up], [act], 3 * d * sbf, 5 * d * sbf, saves=[gate, up]
            )
        mlp_out = self.tensor(p + "fc2.out", d * self.sbh)
        self.gemm(p + "fc2", act, [mlp_out], self.tokens, h, f, saves=[act])
        return mlp_out

    def layer(self, p: str, x: str) -> str:
        """One decoder layer: norm, attention, residual add, norm, MLP, residual add."""
        d, sbh, h = self.c.dtype_bytes, self.sbh, self.c.hidden
        n1 = self.tensor(p + "norm1.out", d * sbh)
        self.elementwise(p + "norm1", [x], [n1], 2 * d * sbh, 3 * d * sbh, saves=[x])
        q, k, v = self.qkv(p, n1)
        o = self.attention(p, q, k, v)
        attn_proj = self.tensor(p + "attn.proj", d * sbh)
        self.gemm(p + "out_proj", o, [attn_proj], self.tokens, h, h, saves=[o])
        h1 = self.tensor(p + "h1", d * sbh)
        self.residual_add(p + "add1", [attn_proj, x], h1)
        n2 = self.tensor(p + "norm2.out", d * sbh)
        self.elementwise(p + "norm2", [h1], [n2], 2 * d * sbh, 3 * d * sbh, saves=[h1])
        mlp_out = self.mlp(p, n2)
        x_next = self.tensor(p + "out", d * sbh)
        self.residual_add(p + "add2", [mlp_out, h1], x_next)
        return x_next

    def head(self, x: str) -> None:
        """The final norm, the vocabulary projection when the config has one, and the loss."""
        c, d, sbh, tokens = self.c, self.c.dtype_bytes, self.sbh, self.tokens
        nf = self.tensor("final_norm.out", d * sbh)
        self.elementwise("final_norm", [x], [nf], 2 * d * sbh, 3 * d * sbh, saves=[x])
        if c.vocab:
            logits = self.tensor("head.logits", d * tokens * c.vocab)
            self.gemm("head", nf, [logits], tokens, c.vocab, c.hidden, saves=[nf])
            loss = self.tensor("loss", 4)
            traffic = d * tokens * c.vocab
            self.elementwise(
                "loss", [logits], [loss], traffic, 2 * traffic, saves=[logits], kind="loss"
            )
        else:
            loss = self.tensor("loss", 4)
            self.elementwise("loss", [nf], [loss], d * sbh, d * sbh, kind="loss")


def transformer_graph(
    config: TransformerConfig, hw: Hardware | str, name: str | None = None
) -> ActivationGraph:
    """The kernel-level activation graph of one training step of ``config`` on ``hw``.

    Args:
        config: the transformer's shapes.
        hw: the hardware whose roofline times the ops.
        name: the graph's name (default from the config).

    Returns:
        The graph.
    """
    hw = hardware(hw)
    c = config
    B = _Builder(c, hw)
    d, sbh = c.dtype_bytes, B.sbh
    x = B.tensor("embed.out", d * sbh)
    B.elementwise("embed", ["tokens"], [x], 2 * d * sbh, 2 * d * sbh)
    for layer in range(c.layers):
        x = B.layer(f"L{layer}.", x)
    B.head(x)
    return B.graph(name or f"transformer-{c.layers}x{c.hidden}", {})


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
    they cross the host link is the hardware's ``collectives_on_link``.

    Args:
        name: a workload's name (WORKLOADS: "bert-large", "gpt2-xl", "llama-7b", ...).
        hw: the hardware whose roofline times the ops.
        fsdp_world: shard the parameters over this many ranks (FSDP): its collectives join the
            graph.
        reshard_after_forward: FSDP's option (the all-gathers run again in backward).

    Returns:
        The graph.

    Raises:
        ValueError: an unknown workload.
    """
    try:
        config = WORKLOADS[name]
    except KeyError:
        raise ValueError(
            f"unknown workload {name!r}; known: {', '.join(sorted(WORKLOADS))}"
        ) from None
    graph = transformer_graph(config, hw, name=name)
    if fsdp_world is None:
        return graph

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


def stage_graph(
    config: TransformerConfig,
    hw: Hardware | str,
    stage: int,
    stages: int,
    name: str | None = None,
) -> ActivationGraph:
    """One pipeline stage's step for one micro-batch (formulations/pipeline.md): the layers
    ``stage`` holds when ``config.layers`` are split evenly over ``stages`` (the first stages
    take one more where they do not divide), the embedding on the first stage, the final norm,
    the head and the loss on the last. A later stage starts from the activation it receives
    (``recv``: made by the previous stage, so it cannot be rebuilt here), which its first norm
    saves for backward; a stage before the last ends with its last layer's output, sent on.

    Args:
        config: the whole model's shapes.
        hw: the hardware whose roofline times the ops.
        stage: which stage (from 0).
        stages: how many.
        name: the graph's name (default from the config and the stage).

    Returns:
        The graph, with ``extra["pipeline_stage"]`` naming the stage.
    """
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stage_graph: stages must be a positive integer, got {stages!r}")
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < stages:
        raise ValueError(f"stage_graph: stage must be 0..{stages - 1}, got {stage!r}")
    if stages > config.layers:
        raise ValueError(f"stage_graph: {stages} stages for {config.layers} layers")
    hw = hardware(hw)
    c = config
    per, extra_layers = divmod(c.layers, stages)
    first = stage * per + min(stage, extra_layers)
    count = per + (1 if stage < extra_layers else 0)
    B = _Builder(c, hw)
    d, sbh = c.dtype_bytes, B.sbh
    if stage == 0:
        x = B.tensor("embed.out", d * sbh)
        B.elementwise("embed", ["tokens"], [x], 2 * d * sbh, 2 * d * sbh)
    else:
        # the received activation: its buffer is the stage's input, not something to rerun
        x = B.tensor("recv.out", d * sbh)
        B.elementwise("recv", ["stage_input"], [x], d * sbh, d * sbh)
        B.ops[-1] = replace(B.ops[-1], recomputable=False)
    for layer in range(first, first + count):
        x = B.layer(f"L{layer}.", x)
    if stage == stages - 1:
        B.head(x)
    graph = B.graph(
        name or f"transformer-{c.layers}x{c.hidden}-stage{stage}of{stages}",
        {"pipeline_stage": stage, "pipeline_stages": stages, "layers": [first, first + count]},
    )
    # the residual stream crosses to the next stage, its gradient back
    messages = pipeline_messages(
        graph.ops[0].name,
        graph.ops[-1].name,
        d * sbh if stage > 0 else 0,
        d * sbh if stage < stages - 1 else 0,
    )
    return replace(graph, collectives=messages)


def workload_stages(
    name: str, stages: int, hw: Hardware | str = "a100-80gb-pcie4"
) -> list[ActivationGraph]:
    """A reference workload split into ``stages`` pipeline stages (``stage_graph``).

    Args:
        name: a workload's name (WORKLOADS).
        stages: how many stages.
        hw: the hardware whose roofline times the ops.

    Returns:
        The stages' graphs, in order.
    """
    try:
        config = WORKLOADS[name]
    except KeyError:
        raise ValueError(
            f"unknown workload {name!r}; known: {', '.join(sorted(WORKLOADS))}"
        ) from None
    return [
        stage_graph(config, hw, s, stages, name=f"{name}-stage{s}of{stages}") for s in range(stages)
    ]
