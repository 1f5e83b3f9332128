"""The analytic CNN graphs: what each layer saves (PyTorch's autograd), the roofline times, and
the shapes that make them hard (skips, pooling indices)."""

import pytest

import slackswap as ss

HW = ss.hardware("a100-80gb-pcie4")


def test_vgg16_first_layer_by_hand():
    g = ss.cnn_graph("vgg16", HW, batch=2, side=32)
    conv = g.ops[g.op_index["conv1_1.conv"]]
    # 2 images x 32 x 32 pixels x 64 out x 3 in x 3 x 3 kernel x 2 FLOPs = 7,077,888 FLOPs; the
    # first layer's backward computes the weight gradient only: the same FLOPs
    flops = 2 * 2 * 32 * 32 * 64 * 3 * 9
    io = 2 * (2 * 3 * 32 * 32 + 2 * 64 * 32 * 32 + 64 * 3 * 9)
    expected = max(flops / (0.7 * 312e12), io / (0.8 * 2.039e12))
    assert conv.forward_s == pytest.approx(expected) and conv.backward_s == pytest.approx(expected)
    out = g.tensors[g.tensor_index["conv1_1.conv.out"]]
    assert out.bytes == 2 * 2 * 64 * 32 * 32  # bf16
    assert out.saved_for == ("conv1_1.bn",)  # batch norm saves its input
    relu = g.tensors[g.tensor_index["conv1_1.relu.out"]]
    assert set(relu.saved_for) == {
        "conv1_1.relu",
        "conv1_2.conv",
    }  # ReLU its output, conv its input


def test_segnet_indices_reach_the_decoder_and_unet_skips_live_across():
    seg = ss.cnn_graph("segnet", HW, batch=1, side=64)
    idx = seg.tensors[seg.tensor_index["pool1.indices"]]
    assert idx.bytes == 8 * 64 * 32 * 32  # int64 per pooled element
    assert set(idx.saved_for) == {"pool1", "unpool5"}
    unet = ss.cnn_graph("unet", HW, batch=1, side=64)
    skip = unet.tensor_index["enc1_2.relu.out"]
    assert unet.ops[unet.last_forward_use[skip]].name == "cat1"  # read again at the very end


@pytest.mark.parametrize("name", ss.CNN_SHAPES)
def test_every_cnn_plans_and_checks(name):
    g = ss.cnn_graph(name, HW, batch=2, side=64)
    assert len(g.saved) > 10
    for allowed in (None, ("keep", "recompute")):
        plan = ss.solve(g, 0.8, HW, solver="heuristic", allowed=allowed)
        assert ss.validate(g, plan).ok


def test_bad_cnn_arguments_are_named():
    with pytest.raises(ValueError, match="unknown CNN 'alexnet'"):
        ss.cnn_graph("alexnet")
    with pytest.raises(ValueError, match="side must be a multiple of 32"):
        ss.cnn_graph("vgg16", side=100)
    with pytest.raises(ValueError, match="batch must be a positive integer"):
        ss.cnn_graph("vgg16", batch=0)
