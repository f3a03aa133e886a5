"""`model.compile`: the denoiser is compiled in place after its adapter is attached, and only when asked."""

import pytest
import torch

from diffrl.config import ModelGroup
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
