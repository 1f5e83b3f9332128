"""Analytic CNN training graphs at layer granularity, with roofline op times.

The shapes of the classic CNN training graphs that rematerialisation planners are measured on:
VGG16/19 (chains), FCN8 (a VGG trunk with skip adds), SegNet (an encoder whose pooling indices
reach the mirrored decoder), U-Net (long skip concatenations), MobileNet (depthwise-separable
blocks), ResNet50 (bottlenecks with residual adds). What each op saves for backward follows
PyTorch's autograd: a convolution or linear layer its input, batch norm its input, ReLU its
output, max pooling its input and indices, the loss its log-probabilities; adds, concatenations
and average pooling save nothing.

Op time is max(FLOPs / (gemm_efficiency * peak), bytes / (memory_efficiency * HBM)) with the
hardware preset's figures, as for the transformer workloads; backward does twice the forward's
FLOPs for a convolution (gradients of input and weight), once for the first one (no input
gradient).
"""

from __future__ import annotations

from collections.abc import Sequence

from .core.graph import ActivationGraph, Op, Tensor
from .core.hardware import Hardware, hardware

# name -> (builder, default batch, input side)
CNN_SHAPES = ("vgg16", "vgg19", "fcn8", "segnet", "unet", "mobilenet", "resnet50")

_VGG = {
    "vgg16": [
        64,
        64,
        "M",
        128,
        128,
        "M",
        256,
        256,
        256,
        "M",
        512,
        512,
        512,
        "M",
        512,
        512,
        512,
        "M",
    ],
    "vgg19": [
        64,
        64,
        "M",
        128,
        128,
        "M",
        256,
        256,
        256,
        256,
        "M",
        512,
        512,
        512,
        512,
        "M",
        512,
        512,
        512,
        512,
        "M",
    ],
}


class _Net:
    """Builds the op list; every tensor is (batch, channels, side, side) at ``dtype_bytes``."""

    def __init__(self, hw: Hardware, batch: int, dtype_bytes: int = 2):
        self.hw, self.batch, self.d = hw, batch, dtype_bytes
        self.ops: list[Op] = []
        self.tensors: dict[str, list] = {}  # name -> [bytes, saved_for]
        self.shape: dict[str, tuple[int, int]] = {}  # name -> (channels, side)
        self.first = True

    def _time(self, flops: float, nbytes: float) -> float:
        hw = self.hw
        return max(
            flops / (hw.gemm_efficiency * hw.peak_flops),
            nbytes / (hw.memory_efficiency * hw.hbm_bytes_per_s),
        )

    def elems(self, name: str) -> int:
        c, side = self.shape[name]
        return self.batch * c * side * side

    def new(self, name: str, channels: int, side: int, element_bytes: int | None = None) -> str:
        self.shape[name] = (channels, side)
        size = (
            (self.d if element_bytes is None else element_bytes)
            * self.batch
            * channels
            * side
            * side
        )
        self.tensors[name] = [int(size), []]
        return name

    def add_op(
        self,
        name: str,
        inputs: list[str],
        outputs: list[str],
        fwd: tuple[float, float],
        bwd: tuple[float, float],
        kind: str,
        saves: Sequence[str] = (),
    ) -> None:
        self.ops.append(
            Op(
                name=name,
                forward_s=self._time(*fwd),
                backward_s=self._time(*bwd),
                inputs=tuple(inputs),
                outputs=tuple(outputs),
                extra={"kind": kind},
            )
        )
        for t in saves:
            if t in self.tensors:
                self.tensors[t][1].append(name)

    def conv(
        self, name: str, x: str, out_c: int, k: int = 3, stride: int = 1, groups: int = 1
    ) -> str:
        in_c, side = self.shape[x]
        out_side = max(1, side // stride)
        y = self.new(name + ".out", out_c, out_side)
        flops = 2.0 * self.batch * out_side * out_side * out_c * (in_c // groups) * k * k
        io = self.d * (self.elems(x) + self.elems(y) + out_c * (in_c // groups) * k * k)
        # backward: weight gradient, and the input gradient except for the first layer
        grads = 1.0 if self.first else 2.0
        self.first = False
        self.add_op(
            name,
            [x],
            [y],
            (flops, io),
            (grads * flops, grads * io),
            "depthwise" if groups > 1 else "conv",
            saves=[x],
        )
        return y

    def bn(self, name: str, x: str) -> str:
        c, side = self.shape[x]
        y = self.new(name + ".out", c, side)
        n = self.d * self.elems(x)
        self.add_op(name, [x], [y], (0.0, 3 * n), (0.0, 4 * n), "norm", saves=[x])
        return y

    def relu(self, name: str, x: str) -> str:
        c, side = self.shape[x]
        y = self.new(name + ".out", c, side)
        n = self.d * self.elems(x)
        self.add_op(name, [x], [y], (0.0, 2 * n), (0.0, 3 * n), "memory", saves=[y])
        return y

    def conv_bn_relu(
        self,
        name: str,
        x: str,
        out_c: int,
        k: int = 3,
        stride: int = 1,
        groups: int = 1,
        relu: bool = True,
    ) -> str:
        y = self.bn(name + ".bn", self.conv(name + ".conv", x, out_c, k, stride, groups))
        return self.relu(name + ".relu", y) if relu else y

    def maxpool(self, name: str, x: str, keep_indices: bool = False) -> tuple[str, str]:
        c, side = self.shape[x]
        y = self.new(name + ".out", c, side // 2)
        idx = self.new(name + ".indices", c, side // 2, element_bytes=8)
        n_in, n_out = self.d * self.elems(x), self.d * self.elems(y)
        self.add_op(
            name,
            [x],
            [y, idx],
            (0.0, n_in + n_out + 4 * n_out),
            (0.0, 2 * n_in + n_out + 4 * n_out),
            "memory",
            saves=[x, idx],
        )
        return y, idx

    def unpool(self, name: str, x: str, idx: str) -> str:
        c, side = self.shape[x]
        y = self.new(name + ".out", c, side * 2)
        n = self.d * (self.elems(x) + self.elems(y))
        self.add_op(
            name,
            [x, idx],
            [y],
            (0.0, n + 4 * self.elems(x)),
            (0.0, n + 4 * self.elems(x)),
            "memory",
            saves=[idx],
        )
        return y

    def upconv(self, name: str, x: str, out_c: int, factor: int = 2) -> str:
        """A transposed convolution that scales the side by ``factor`` (kernel = factor)."""
        in_c, side = self.shape[x]
        y = self.new(name + ".out", out_c, side * factor)
        flops = 2.0 * self.batch * side * side * in_c * out_c * factor * factor
        io = self.d * (self.elems(x) + self.elems(y))
        self.add_op(name, [x], [y], (flops, io), (2 * flops, 2 * io), "conv", saves=[x])
        return y

    def add(self, name: str, a: str, b: str) -> str:
        c, side = self.shape[a]
        y = self.new(name + ".out", c, side)
        n = self.d * self.elems(a)
        self.add_op(name, [a, b], [y], (0.0, 3 * n), (0.0, 3 * n), "memory")
        return y

    def cat(self, name: str, a: str, b: str) -> str:
        (ca, side), (cb, _) = self.shape[a], self.shape[b]
        y = self.new(name + ".out", ca + cb, side)
        n = self.d * self.elems(y)
        self.add_op(name, [a, b], [y], (0.0, 2 * n), (0.0, 2 * n), "memory")
        return y

    def avgpool(self, name: str, x: str) -> str:
        c, _ = self.shape[x]
        y = self.new(name + ".out", c, 1)
        n = self.d * self.elems(x)
        self.add_op(name, [x], [y], (0.0, n), (0.0, n), "memory")
        return y

    def linear(self, name: str, x: str, out_f: int) -> str:
        c, side = self.shape[x]
        in_f = c * side * side
        y = self.new(name + ".out", out_f, 1)
        flops = 2.0 * self.batch * in_f * out_f
        io = self.d * (self.batch * (in_f + out_f) + in_f * out_f)
        self.add_op(name, [x], [y], (flops, io), (2 * flops, 2 * io), "gemm", saves=[x])
        return y

    def loss(self, x: str) -> None:
        c, side = self.shape[x]
        logp = self.new("loss.log_probs", c, side)
        n = self.d * self.elems(x)
        self.add_op("log_softmax", [x], [logp], (0.0, 2 * n), (0.0, 3 * n), "memory", saves=[logp])
        self.tensors["loss"] = [4, []]
        self.add_op("nll_loss", [logp], ["loss"], (0.0, n), (0.0, 2 * n), "loss")

    def graph(self, name: str, extra: dict) -> ActivationGraph:
        tensors = tuple(
            Tensor(name=n, bytes=v[0], saved_for=tuple(v[1])) for n, v in self.tensors.items()
        )
        return ActivationGraph(
            name=name, ops=tuple(self.ops), tensors=tensors, optimizer_s=0.0, extra=extra
        )


def _vgg_trunk(
    net: _Net, x: str, config: list, indices: list | None = None, taps: list | None = None
) -> str:
    stage, i = 1, 1
    for item in config:
        if item == "M":
            x, idx = net.maxpool(f"pool{stage}", x)
            if indices is not None:
                indices.append(idx)
            if taps is not None:
                taps.append(x)
            stage, i = stage + 1, 1
        else:
            x = net.conv_bn_relu(f"conv{stage}_{i}", x, int(item))
            i += 1
    return x


def _vgg(net: _Net, x: str, depth: str, classes: int) -> None:
    x = _vgg_trunk(net, x, _VGG[depth])
    x = net.relu("fc6.relu", net.linear("fc6", x, 4096))
    x = net.relu("fc7.relu", net.linear("fc7", x, 4096))
    net.loss(net.linear("fc8", x, classes))


def _fcn8(net: _Net, x: str, classes: int) -> None:
    taps: list[str] = []
    x = _vgg_trunk(net, x, _VGG["vgg16"], taps=taps)
    x = net.relu("fc6.relu", net.conv("fc6", x, 4096, k=7))
    x = net.relu("fc7.relu", net.conv("fc7", x, 4096, k=1))
    score = net.conv("score_fr", x, classes, k=1)
    up2 = net.upconv("upscore2", score, classes)
    fused4 = net.add("fuse_pool4", up2, net.conv("score_pool4", taps[3], classes, k=1))
    up4 = net.upconv("upscore_pool4", fused4, classes)
    fused3 = net.add("fuse_pool3", up4, net.conv("score_pool3", taps[2], classes, k=1))
    net.loss(net.upconv("upscore8", fused3, classes, factor=8))


def _segnet(net: _Net, x: str, classes: int) -> None:
    indices: list[str] = []
    x = _vgg_trunk(net, x, _VGG["vgg16"], indices=indices)
    blocks = [[512, 512, 512], [512, 512, 256], [256, 256, 128], [128, 64], [64]]
    for stage, (widths, idx) in enumerate(zip(blocks, reversed(indices)), start=1):
        x = net.unpool(f"unpool{stage}", x, idx)
        for i, w in enumerate(widths, start=1):
            x = net.conv_bn_relu(f"dec{stage}_{i}", x, w)
    net.loss(net.conv("classifier", x, classes, k=3))


def _unet(net: _Net, x: str, classes: int) -> None:
    skips = []
    for level, width in enumerate((64, 128, 256, 512), start=1):
        x = net.conv_bn_relu(f"enc{level}_2", net.conv_bn_relu(f"enc{level}_1", x, width), width)
        skips.append(x)
        x, _ = net.maxpool(f"down{level}", x)
    x = net.conv_bn_relu("mid_2", net.conv_bn_relu("mid_1", x, 1024), 1024)
    for level, width in zip((4, 3, 2, 1), (512, 256, 128, 64)):
        x = net.cat(f"cat{level}", net.upconv(f"up{level}", x, width), skips[level - 1])
        x = net.conv_bn_relu(f"dec{level}_2", net.conv_bn_relu(f"dec{level}_1", x, width), width)
    net.loss(net.conv("head", x, classes, k=1))


def _mobilenet(net: _Net, x: str, classes: int) -> None:
    x = net.conv_bn_relu("stem", x, 32, stride=2)
    plan = [
        (64, 1),
        (128, 2),
        (128, 1),
        (256, 2),
        (256, 1),
        (512, 2),
        (512, 1),
        (512, 1),
        (512, 1),
        (512, 1),
        (512, 1),
        (1024, 2),
        (1024, 1),
    ]
    for i, (width, stride) in enumerate(plan, start=1):
        c, _ = net.shape[x]
        x = net.conv_bn_relu(f"block{i}.dw", x, c, stride=stride, groups=c)
        x = net.conv_bn_relu(f"block{i}.pw", x, width, k=1)
    net.loss(net.linear("fc", net.avgpool("avgpool", x), classes))


def _resnet50(net: _Net, x: str, classes: int) -> None:
    x = net.conv_bn_relu("stem", x, 64, k=7, stride=2)
    x, _ = net.maxpool("stem.pool", x)
    for stage, (blocks, width) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512)), start=1):
        for b in range(blocks):
            p = f"layer{stage}.{b}"
            stride = 2 if b == 0 and stage > 1 else 1
            y = net.conv_bn_relu(p + ".a", x, width, k=1)
            y = net.conv_bn_relu(p + ".b", y, width, stride=stride)
            y = net.conv_bn_relu(p + ".c", y, 4 * width, k=1, relu=False)
            short = (
                net.conv_bn_relu(p + ".down", x, 4 * width, k=1, stride=stride, relu=False)
                if b == 0
                else x
            )
            x = net.relu(p + ".relu", net.add(p + ".add", y, short))
    net.loss(net.linear("fc", net.avgpool("avgpool", x), classes))


_BUILDERS = {
    "vgg16": (lambda n, x, k: _vgg(n, x, "vgg16", k), 224, 1000),
    "vgg19": (lambda n, x, k: _vgg(n, x, "vgg19", k), 224, 1000),
    "fcn8": (_fcn8, 512, 21),
    "segnet": (_segnet, 416, 12),
    "unet": (_unet, 512, 2),
    "mobilenet": (_mobilenet, 224, 1000),
    "resnet50": (_resnet50, 224, 1000),
}


def cnn_graph(
    name: str,
    hw: Hardware | str = "a100-80gb-pcie4",
    batch: int = 16,
    side: int | None = None,
    dtype_bytes: int = 2,
) -> ActivationGraph:
    """The layer-level activation graph of one training step of the CNN ``name`` (one of
    CNN_SHAPES) on ``hw``: ``batch`` images of ``side`` x ``side`` pixels (the network's usual
    input side by default).

    Args:
        name: one of CNN_SHAPES ("vgg16", "resnet50", "unet", ...).
        hw: the hardware (or its preset name) whose roofline times the ops.
        batch: images per step.
        side: the input's side in pixels (default the network's usual one).
        dtype_bytes: bytes per activation element (2: half precision).

    Returns:
        The graph, named after the network, batch and side.

    Raises:
        ValueError: an unknown network, or a batch, side or dtype_bytes that is not a positive
            integer.
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown CNN {name!r}; known: {', '.join(CNN_SHAPES)}")
    for label, value in (("batch", batch), ("dtype_bytes", dtype_bytes)) + (
        (("side", side),) if side is not None else ()
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"cnn_graph: {label} must be a positive integer, got {value!r}")
    build, default_side, classes = _BUILDERS[name]
    side = default_side if side is None else side
    if side % 32:
        raise ValueError(f"cnn_graph: side must be a multiple of 32 (five 2x poolings), got {side}")
    hw = hardware(hw)
    net = _Net(hw, batch, dtype_bytes)
    net.shape["image"] = (3, side)
    build(net, "image", classes)
    return net.graph(
        f"{name}-b{batch}-{side}px",
        {"cnn": name, "batch": batch, "side": side, "hardware": hw.name},
    )
