"""`model.compile`: the denoiser is compiled in place after its adapter is attached, and only when asked."""

import shutil

import pytest
import torch
from diffusers.models.resnet import ResnetBlock2D

from diffrl.config import ModelGroup
from diffrl.models.base import run_denoiser
from diffrl.training.weights import setup_policy_weights


@pytest.mark.parametrize("compile_", [True, False])
def test_the_denoiser_is_compiled_in_place_after_the_adapter_only_when_asked(tiny_sd, monkeypatch, compile_):
    import copy

    unet = copy.deepcopy(tiny_sd.unet)
    seen = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *a, **k: seen.append(
        (self, sorted(n for n, _ in self.named_parameters() if "lora_" in n))))
    model = ModelGroup(pipeline="x", compile=compile_)
    params = setup_policy_weights(unet, model, use_lora=True)
    if compile_:
        (module, lora_names), = seen
        assert module is unet and len(lora_names) == len(params) > 0  # compiled with the adapter in place
        assert not any(k.startswith("_orig_mod") for k in unet.state_dict())
    else:
        assert seen == []


class _Denoiser(torch.nn.Module):
    """A LoRA-like trainable scale in front of a frozen diffusers ResnetBlock2D (GroupNorm, SiLU, convolutions): on
    this block torch.compile's no-grad graph and its grad-mode graph round differently (6e-7 measured on an AVX2 AMD
    CPU), which is what the rollout must not see."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(48, 1, 1))
        self.block = ResnetBlock2D(in_channels=48, out_channels=96, temb_channels=64, groups=8)
        self.block.requires_grad_(False)

    def forward(self, x, temb):
        return (self.block(x * self.scale, temb),)


def test_a_compiled_denoiser_runs_in_grad_mode_without_a_graph_where_gradients_are_off():
    net = _Denoiser()
    seen = []

    def compiled(*args, **kwargs):
        seen.append(torch.is_grad_enabled())
        return net._call_impl(*args, **kwargs)

    x, temb = torch.randn(2, 48, 4, 4), torch.randn(2, 64)
    with torch.no_grad():
        run_denoiser(net, x, temb)  # eager: called as it is
        net._compiled_call_impl = compiled
        (out,) = run_denoiser(net, x, temb)
    assert seen == [True] and not out.requires_grad and out.grad_fn is None
    out_train = run_denoiser(net, x, temb)[0]  # grad mode already: the module's own output, graph and all
    assert seen == [True, True] and out_train.grad_fn is not None


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="torch.compile on a CPU needs a C++ compiler")
def test_a_compiled_denoisers_no_grad_output_equals_its_training_output_exactly():
    """The rollout's call (gradients off) and the training pass's call of a compiled denoiser give the same bits, so
    the first PPO ratio is exactly 1."""
    torch.manual_seed(0)
    net = _Denoiser()
    net.compile()
    x, temb = torch.randn(16, 48, 4, 4), torch.randn(16, 64)
    with torch.no_grad():
        (rollout,) = run_denoiser(net, x, temb)
    (train,) = net(x, temb)
    assert train.grad_fn is not None
    assert torch.equal(rollout, train.detach())
