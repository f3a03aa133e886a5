"""Names of the models that ship inside diffrl (the ShapesWorld assets) and where they live.

`diffrl.load_pipeline("tiny-shapes")`, `get_reward("clip_score", model="tiny-shapes-clip")` and friends
resolve these names here, so nothing about the embedded world touches the hub.
"""

from pathlib import Path

from diffrl.errors import UserError

ASSETS = Path(__file__).parent / "shapes" / "assets"

# name -> (folder under ASSETS, what it is, how to rebuild it)
EMBEDDED_MODELS = {
    "tiny-shapes": ("tiny-shapes", "StableDiffusionPipeline, 32x32, DDIM", "python -m diffrl.shapes.train unet"),
    "tiny-shapes-lcm": ("tiny-shapes-lcm", "LatentConsistencyModelPipeline, 32x32", "python -m diffrl.shapes.train lcm"),
    "tiny-shapes-flow": ("tiny-shapes-flow", "StableDiffusion3Pipeline, 32x32, rectified flow",
                         "python -m diffrl.shapes.train flow"),
    "tiny-shapes-clip": ("tiny-shapes-clip", "transformers CLIPModel", "python -m diffrl.shapes.train clip"),
    "tiny-shapes-pickscore": ("tiny-shapes-pickscore", "PickScore-style CLIPModel", "python -m diffrl.shapes.train pickscore"),
}


def is_embedded(name: str) -> bool:
    return str(name) in EMBEDDED_MODELS


def is_pipeline(name: str) -> bool:
    """Whether an embedded model is a diffusers pipeline (the others are reward backbones)."""
    return "Pipeline" in EMBEDDED_MODELS[name][1]


def is_built(name: str) -> bool:
    """Whether an embedded model's weights are in this install: a pipeline needs its model_index.json (a build
    that stopped half way leaves only some components), a model its config and weights."""
    path = ASSETS / EMBEDDED_MODELS[name][0]
    marker = "model_index.json" if is_pipeline(name) else "config.json"
    return (path / marker).is_file() and any(path.rglob("*.safetensors"))


def embedded_path(name: str) -> Path:
    """Folder of an embedded model; a `UserError` if its weights are not built into this install."""
    folder, _, rebuild = EMBEDDED_MODELS[name]
    path = ASSETS / folder
    if is_built(name):
        return path
    if path.is_dir() and any(path.iterdir()):
        raise UserError(f"embedded model '{name}' is not fully built in {path} (a build stopped half way?); "
                        f"rebuild it with `{rebuild}`")
    raise UserError(f"embedded model '{name}' has no weights in {path}; build them with `{rebuild}`")
