"""hpsv2 / hpsv21 on a tiny open_clip model saved as an HPS checkpoint (`{"state_dict": ...}`).

The reference builds the same open_clip model directly, loads the checkpoint's state dict, preprocesses with
HPSv2's validation transform written out here, and applies the published formula (normalised image features ·
normalised text features). The torch path must match it to float precision (same operations on the same
uint8-grid pixels); against open_clip's own PIL-based `resize_mode="longest"` transform it must agree within
2% of the between-image spread (PIL resamples in two uint8 passes).
"""

import open_clip
import pytest
import torch
import torchvision.transforms as T
import torchvision.transforms.functional as TF
from reward_testing import PROMPTS, quantised, sample_images, tiny_hps

from diffrl.errors import UserError
from rewards import get_reward
from rewards.preprocess import CLIP_MEAN, CLIP_STD, pil_to_tensor, to_pil


def hpsv2_transform(image, size=224):
    # HPSv2 validation transform: ToTensor, resize the longest side (tensor, bicubic), pad with 0, normalise.
    x = pil_to_tensor(image)
    height, width = x.shape[-2:]
    scale = size / max(height, width)
    if scale != 1.0:
        new = (round(height * scale), round(width * scale))
        x = TF.resize(x, list(new), T.InterpolationMode.BICUBIC, antialias=True)
        pad_h, pad_w = size - new[0], size - new[1]
        x = TF.pad(x, [pad_w // 2, pad_h // 2, pad_w - pad_w // 2, pad_h - pad_h // 2], fill=0)
    return TF.normalize(x, CLIP_MEAN, CLIP_STD)


def reference_model():
    options = tiny_hps()
    model = open_clip.create_model(f"local-dir:{options['architecture']}", pretrained=None)
    model.load_state_dict(torch.load(options["checkpoint"], weights_only=True)["state_dict"])
    return model.eval(), open_clip.get_tokenizer(f"local-dir:{options['architecture']}")


@pytest.fixture(scope="module")
def images():
    return quantised(sample_images(240, 320))


def test_hps_formula(images):
    model, tokenizer = reference_model()
    with torch.no_grad():
        pixels = torch.stack([hpsv2_transform(image) for image in to_pil(images)])
        image_features, text_features = model.encode_image(pixels), model.encode_text(tokenizer(PROMPTS))
    image_features = image_features / image_features.norm(dim=-1, keepdim=True)
    text_features = text_features / text_features.norm(dim=-1, keepdim=True)
    expected = (image_features * text_features).sum(-1)

    for name in ("hpsv2", "hpsv21"):
        for preprocess in ("processor", "torch"):
            reward = get_reward(name, preprocess=preprocess, device="cpu", **tiny_hps())
            assert reward.name == name
            torch.testing.assert_close(reward(images, PROMPTS).scores, expected, atol=1e-5, rtol=1e-5)

    # open_clip's own PIL-based transform with HPSv2's resize mode.
    open_clip_transform = open_clip.image_transform(224, is_train=False, resize_mode="longest")
    with torch.no_grad():
        pixels = torch.stack([open_clip_transform(image) for image in to_pil(images)])
        features = model.encode_image(pixels, normalize=True)
    via_open_clip = (features * text_features).sum(-1)
    assert (via_open_clip - expected).abs().max() <= 0.02 * expected.std()


def test_hps_gradients_and_defaults():
    reward = get_reward("hpsv2", device="cpu", **tiny_hps())
    assert reward.differentiable and reward.higher_is_better
    images = sample_images(96, 64)[:2].requires_grad_(True)
    reward(images, PROMPTS[:2]).scores.sum().backward()
    assert torch.isfinite(images.grad).all() and (images.grad.abs().sum(dim=(1, 2, 3)) > 0).all()
    assert not any(p.requires_grad for p in reward.model.parameters())


def test_hps_checkpoint_errors(tmp_path):
    options = tiny_hps()
    with pytest.raises(UserError, match="is not a file"):
        get_reward("hpsv2", checkpoint=str(tmp_path / "missing.pt"), architecture=options["architecture"])
    bad = tmp_path / "bad.pt"
    torch.save({"state_dict": {"visual.proj": torch.zeros(2, 2)}}, bad)
    with pytest.raises(UserError, match="does not fit open_clip"):
        get_reward("hpsv2", checkpoint=str(bad), architecture=options["architecture"], device="cpu")
    with pytest.raises(UserError, match="neither an open_clip config name"):
        get_reward("hpsv2", checkpoint=options["checkpoint"], architecture="ViT-Q-99", device="cpu")
