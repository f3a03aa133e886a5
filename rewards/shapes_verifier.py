"""`shapes_verifier`: the ShapesWorld verifier as a reward (the fraction of a caption's clauses that an image
satisfies, in [0, 1]). The pixel analysis lives in `diffrl.shapes.verifier`; this module only adapts it to
the reward protocol. Not differentiable (connected components and thresholds have no useful gradient).

`shapes_verifier_map` is the same verifier as dense feedback for PXPO (`diffrl.trainers.pxpo`): per image a map
[H, W] in [-1, 1] — +1 on the pixels of an object whose clauses hold, -1 on an object whose clauses fail or that no
clause asks for, the background's pixels scored by the background clause and the missing objects
(`diffrl.shapes.verifier.feedback_map` has the exact rule) — in `info["maps"]`, and as its scalar score the map's
mean, so it also serves as a plain reward where maps are not used.
"""

from __future__ import annotations

from diffrl.shapes.verifier import parse_caption, verify, verify_maps
from rewards.base import RewardOutput, check_inputs
from rewards.registry import register_reward


class ShapesVerifierReward:
    """Fraction of caption clauses satisfied; `info["details"]` holds every clause's verdict per image."""

    name = "shapes_verifier"
    differentiable = False
    higher_is_better = True

    def __call__(self, images, prompts, metadata=None) -> RewardOutput:
        prompts = check_inputs(self.name, images, prompts, metadata)
        scores, details = verify(images.detach(), prompts)
        return RewardOutput(scores=scores.to(images.device), info={"details": details})

    def check_prompts(self, prompts) -> None:
        """Raise the `UserError` of the first prompt the verifier cannot read, before any image is sampled."""
        for prompt in prompts:
            parse_caption(prompt)


@register_reward("shapes_verifier", differentiable=False)
def shapes_verifier() -> ShapesVerifierReward:
    """The ShapesWorld verifier: fraction of the caption's clauses the image satisfies (object colour and
    shape, count, relation, background), by pixel analysis."""
    return ShapesVerifierReward()


class ShapesVerifierMapReward:
    """Per-pixel ShapesWorld feedback: `scores` [B] = each map's mean, `info["maps"]` [B, H, W] in [-1, 1],
    `info["verifier"]` [B] the clause fraction of `shapes_verifier` (logged as a component), `info["details"]`."""

    name = "shapes_verifier_map"
    differentiable = False
    higher_is_better = True

    def __call__(self, images, prompts, metadata=None) -> RewardOutput:
        prompts = check_inputs(self.name, images, prompts, metadata)
        maps, fractions, details = verify_maps(images.detach(), prompts)
        maps = maps.to(images.device)
        return RewardOutput(scores=maps.mean(dim=(1, 2)),
                            info={"maps": maps, "verifier": fractions.to(images.device), "details": details})

    check_prompts = ShapesVerifierReward.check_prompts


@register_reward("shapes_verifier_map", differentiable=False)
def shapes_verifier_map() -> ShapesVerifierMapReward:
    """The ShapesWorld verifier as per-pixel feedback (PXPO): a map per image in [-1, 1] (+1 on objects whose
    clauses hold, -1 on wrong or unwanted objects, background by its clause and the missing objects); score = the
    map's mean."""
    return ShapesVerifierMapReward()
