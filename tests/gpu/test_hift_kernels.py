"""The HiFT vocoder on the GPU: its Snake kernel, time-major convolutions and fused resblock against the torch
reference, and its branches on streams against the serial order.
Run on a GPU machine: `pytest tests/gpu/test_hift_kernels.py`. On CPU-only CI the whole module is skipped."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (Triton kernels); the CPU path is tests/engines/speech_out/",
                allow_module_level=True)
pytest.importorskip("triton", reason="the codec kernels are Triton kernels")


def test_snake_is_bit_identical_to_torch():
    """HiFT's Snake in one kernel gives torch's bits (IEEE division, libdevice sinf, no FMA), over alphas from tiny
    to large and inputs spanning many periods; other dtypes and shapes are refused."""
    from engines.kernels.speech_out.snake import snake
    from engines.speech_out.vocoder.hift import Snake

    g = torch.Generator(device="cuda").manual_seed(7)
    B, C, T = 3, 64, 1001  # T not a multiple of the kernel's block: the tail is masked
    x = torch.randn(B, C, T, device="cuda", generator=g) * torch.logspace(-2, 2, T, device="cuda")
    alpha = torch.logspace(-6, 1, C, device="cuda")
    a = alpha[None, :, None]
    want = x + (1.0 / (a + 1e-9)) * torch.sin(a * x).pow(2)
    assert torch.equal(snake(x, alpha), want)
    tm = x.transpose(1, 2).contiguous().transpose(1, 2)  # time-major memory (HiFT's layout on CUDA)
    got = snake(tm, alpha)
    assert torch.equal(got, want) and got.stride() == tm.stride()  # the output keeps the layout
    assert torch.equal(snake(x[:, :, ::2], alpha), want[:, :, ::2])  # other strides: made contiguous first
    module = Snake(C).cuda()
    with torch.no_grad():
        module.alpha.copy_(alpha)
        assert torch.equal(module(x), want)
    with pytest.raises(ValueError, match="float32"):
        snake(x.bfloat16(), alpha)
    with pytest.raises(ValueError, match="alpha"):
        snake(x, alpha[:10])


def test_snake_with_bias_and_residual_is_bit_identical_to_torch():
    """The bias and residual adds taken into the Snake pass give torch's bits: snake(x, alpha, bias) ==
    Snake(x + bias), add_snake(x, bias, r, alpha) == (r + (x + bias), Snake(that)); wrong shapes are refused."""
    from engines.kernels.speech_out.snake import add_snake, snake

    g = torch.Generator(device="cuda").manual_seed(8)
    B, C, T = 2, 48, 777
    x = torch.randn(B, C, T, device="cuda", generator=g) * 3
    r = torch.randn(B, C, T, device="cuda", generator=g)
    bias = torch.randn(C, device="cuda", generator=g)
    alpha = torch.logspace(-3, 1, C, device="cuda")
    a = alpha[None, :, None]

    def ref(v):
        return v + (1.0 / (a + 1e-9)) * torch.sin(a * v).pow(2)

    biased = x + bias[None, :, None]
    assert torch.equal(snake(x, alpha, bias), ref(biased))
    s, y = add_snake(x, bias, r, alpha)
    assert torch.equal(s, r + biased) and torch.equal(y, ref(r + biased))
    s, y = add_snake(x, None, r, None)
    assert torch.equal(s, r + x) and y is None
    # time-major x (HiFT's layout on CUDA) with a residual in either layout: the same bits, x's layout out
    xt = x.transpose(1, 2).contiguous().transpose(1, 2)
    for rr in (r, r.transpose(1, 2).contiguous().transpose(1, 2)):
        s, y = add_snake(xt, bias, rr, alpha)
        assert torch.equal(s, r + biased) and torch.equal(y, ref(r + biased))
        assert s.stride() == y.stride() == xt.stride()
    with pytest.raises(ValueError, match="bias"):
        snake(x, alpha, bias[:3])
    with pytest.raises(ValueError, match="residual"):
        add_snake(x, bias, r[:, :, :5], alpha)


@pytest.mark.parametrize("transposed,k,stride,dilation", [(False, 7, 1, 1), (False, 11, 1, 5), (False, 16, 8, 1),
                                                          (True, 16, 8, 1), (True, 7, 3, 1)])
def test_hift_conv_time_major_matches_the_1d_conv(transposed, k, stride, dilation, deterministic_cudnn):
    """hift.conv on CUDA (a channels-last 2-D conv) gives the 1-D conv's output to TF32 rounding, in time-major memory,
    from time-major or contiguous input, at one row or two; without its bias when asked."""
    from engines.speech_out.vocoder import hift

    torch.manual_seed(3)
    cin, cout = 64, 48
    m = (torch.nn.ConvTranspose1d(cin, cout, k, stride, padding=(k - stride) // 2) if transposed else
         torch.nn.Conv1d(cin, cout, k, stride, padding=(k * dilation - dilation) // 2, dilation=dilation)).cuda()
    x = torch.randn(2, cin, 300, device="cuda")
    with torch.inference_mode():
        want = m(x)
        for inp in (x, x.transpose(1, 2).contiguous().transpose(1, 2)):
            got = hift.conv(m, inp)
            assert got.shape == want.shape and got.transpose(1, 2).is_contiguous()
            torch.testing.assert_close(got, want, rtol=0, atol=2e-3 * float(want.abs().max()))
        no_bias = hift.conv(m, x, bias=False)
        torch.testing.assert_close(no_bias + m.bias[None, :, None], hift.conv(m, x), rtol=0, atol=1e-5)
        one = hift.conv(m, x[:1])
        assert one.transpose(1, 2).is_contiguous()
        torch.testing.assert_close(one, want[:1], rtol=0, atol=2e-3 * float(want.abs().max()))


def test_hift_time_major_matches_the_1d_layout(deterministic_cudnn):
    """The full-size HiFT generator with its activations time-major (on CUDA) gives the 1-D layout's body output
    (before conv_post) and waveform (the CPU's, every conv in float32 on both sides) through its ~90 convs, at 2
    sessions. f0 is held at 0 (unvoiced: the source is the noise alone), since a rounding-sized change of f0 moves the
    harmonic phases a lot over a window; a layout error (a channel read from the wrong place) would be of the
    signal's own size."""
    import copy

    from engines.speech_out.config import HiFTConfig
    from engines.speech_out.vocoder import hift

    torch.manual_seed(0)
    gen = hift.HiFTGenerator(HiFTConfig()).eval()
    gen.fold_weight_norm()
    with torch.no_grad():
        for m in gen.modules():  # small weights keep the 3-stage stack finite
            if isinstance(m, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
                m.weight.mul_(0.3)
        gen.f0_predictor.classifier.weight.zero_()
        gen.f0_predictor.classifier.bias.zero_()
    cpu, gen = gen, copy.deepcopy(gen).cuda()
    g = torch.Generator().manual_seed(1)
    T = 32
    mel = torch.randn(2, 80, T, generator=g) - 5
    phase = torch.rand(2, gen.n_harmonics, generator=g)
    noise = torch.randn(2, gen.n_harmonics, T * gen.cfg.mel.hop, generator=g)
    keep = 20 * gen.cfg.mel.hop
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # float32 convs in full float32, like the CPU
    try:
        with torch.inference_mode():
            body, got_phase = gen._branched(mel.cuda(), phase.cuda(), noise.cuda(), keep)
            assert body.transpose(1, 2).is_contiguous()  # time-major to the end
            got, _ = gen(mel.cuda(), phase.cuda(), noise.cuda(), keep)
            want_body, want_phase = cpu._serial(mel, phase, noise, keep)
            assert want_body.is_contiguous()
            want, _ = cpu(mel, phase, noise, keep)
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    assert want_body.abs().max() > 1e-2 and want.abs().max() > 1e-3
    torch.testing.assert_close(body.cpu(), want_body, rtol=0, atol=1e-2 * float(want_body.abs().max()))
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=5e-2 * float(want.abs().max()))
    assert torch.equal(got_phase.cpu(), want_phase)


@pytest.mark.parametrize("batch", [1, 3])
def test_fused_resblock_is_bit_identical_to_the_reference(batch, deterministic_cudnn):
    """HiFT's resblock with its conv biases and residual adds inside the Snake kernels (the CUDA path) gives the
    reference order's bits (every conv through cuDNN with its bias added by torch, then Snake, then the add)."""
    from torch.nn.utils import parametrize

    from engines.speech_out.vocoder.hift import ResBlock

    torch.manual_seed(0)
    block = ResBlock(64, 7, (1, 3, 5)).cuda().eval()
    with torch.no_grad():
        for m in list(block.modules()):
            if parametrize.is_parametrized(m, "weight"):
                parametrize.remove_parametrizations(m, "weight", leave_parametrized=True)
        for act in (*block.activations1, *block.activations2):
            act.alpha.copy_(torch.rand(64) * 2 + 0.05)
        for conv in (*block.convs1, *block.convs2):
            conv.bias.normal_()
    x = torch.randn(batch, 64, 1001, device="cuda")
    with torch.inference_mode():
        want = block._forward_reference(x)
        got = block(x)
    assert want.abs().max() > 1
    assert torch.equal(got, want)


@pytest.fixture
def deterministic_cudnn():
    """cuDNN's deterministic algorithms: some of the ones it picks otherwise accumulate with atomics, whose order
    changes when kernels share the GPU (HiFT's body: ~3e-8 from run to run at batch 1, ~4e-6 on streams at batch 3,
    H200), which would hide the bits a race between streams changes."""
    before = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = True
    yield
    torch.backends.cudnn.deterministic = before


@pytest.mark.parametrize("batch", [1, 3])
def test_hift_branches_on_streams_equal_the_serial_order(batch, deterministic_cudnn):
    """The full-size HiFT body with its source branch and each stage's resblocks on streams of their own gives the
    serial order's bits (before the iSTFT, whose F.fold adds with atomics), eager with the allocator's blocks moving
    between calls, and replayed from a CUDA graph."""
    from engines.lm.step_graphs import capture_graph, private_stream
    from engines.speech_out.config import HiFTConfig
    from engines.speech_out.vocoder.hift import HiFTGenerator

    torch.manual_seed(0)
    gen = HiFTGenerator(HiFTConfig()).cuda().eval()
    gen.fold_weight_norm()
    with torch.no_grad():
        for m in gen.modules():  # small weights keep the 3-stage stack finite
            if isinstance(m, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
                m.weight.mul_(0.3)
    g = torch.Generator(device="cuda").manual_seed(1)
    T = 32
    mel = torch.randn(batch, 80, T, device="cuda", generator=g) - 5
    phase = torch.rand(batch, gen.n_harmonics, device="cuda", generator=g)
    noise = torch.randn(batch, gen.n_harmonics, T * gen.cfg.mel.hop, device="cuda", generator=g)
    keep = 20 * gen.cfg.mel.hop
    with torch.inference_mode():
        want_x, want_phase = gen._serial(mel, phase, noise, keep)
        assert torch.isfinite(want_x).all() and want_x.abs().max() > 0
        for _ in range(5):
            churn = [torch.randn(1 << 20, device="cuda") for _ in range(4)]  # other blocks free next time
            got_x, got_phase = gen._branched(mel, phase, noise, keep)
            del churn
            assert torch.equal(got_x, want_x) and torch.equal(got_phase, want_phase)
        graph, (graph_x, graph_phase) = capture_graph(lambda: gen._branched(mel, phase, noise, keep),
                                                      private_stream("cuda"))
        for _ in range(3):
            graph_x.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(graph_x, want_x) and torch.equal(graph_phase, want_phase)
