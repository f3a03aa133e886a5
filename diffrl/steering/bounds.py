"""The sizes one request may ask for, in one place: `diffrl steer`, `diffrl sample` and the demo check them before any
model loads, so a typo (`num_samples=100000000`) or a hostile demo request is one line naming the bound, not a
102 GB allocation or hours of work.

What a size costs, per latent row, on the two model sizes diffrl runs (fp32):

| what a row holds                | embedded tiny-shapes (32 px) | SD 1.5 (512 px)  |
|---------------------------------|------------------------------|------------------|
| latents `[4, h, w]`             | 1 KiB (4×8×8)                | 64 KiB (4×64×64) |
| a decoded image `[3, H, W]`     | 12 KiB                       | 3 MiB            |

A steering call holds every row's latents for the whole chain and, when it scores them (best-of-N at the end, FK at
each scheduled step), every row's decoded image at once (`SteerContext.score` keeps them for the final choice);
`rows_per_call` / `--rows-per-call` bounds the rows of one model or reward call, not the rows held. The bounds are
generous for real use (the shipped recipes use at most 8 prompts × 20 SVDD candidates = 160 rows) and stop what
would take a machine's memory.
"""

from __future__ import annotations

from diffrl.errors import UserError

# Latent rows held per prompt (samples, particles, SVDD chains × candidates), and per steering call (prompts steered
# together × rows per prompt; the demo's images × budget). 4096 rows hold 4 MiB of latents and 48 MiB of decoded
# images on the embedded model, 256 MiB and 12 GiB on SD 1.5 at 512 px: the most one large GPU holds. The probe
# that asked for 200000 rows on the embedded model reached ~4 GB resident before failing.
MAX_LATENT_ROWS = 4096
MAX_ROWS_PER_CALL = MAX_LATENT_ROWS
# ReNO's optimiser iterations: each is a generation and a backward pass through it (50 is the paper's default;
# 10000 is ~2 hours of SD-Turbo on a GPU).
MAX_ITERATIONS = 10_000
# The settings of the steering methods that size a call, each per prompt.
SIZE_BOUNDS = {"num_samples": MAX_LATENT_ROWS, "num_particles": MAX_LATENT_ROWS, "num_candidates": MAX_LATENT_ROWS,
               "iterations": MAX_ITERATIONS}
# Denoising steps: 1000 is the num_train_timesteps of SD 1.x/2.x/XL's schedulers, the most distinct timesteps a
# DDIM or LCM chain can take (`checks.check_num_steps` applies the pipeline's own, often smaller, bound). Flow
# schedulers take any count, so this bounds them too: a sampler keeps every step's latents (`[B, T + 1, ...]`,
# 64 MiB per SD 1.5 image at 1000 steps) and 1000 steps are already minutes per image on a GPU.
MAX_NUM_STEPS = 1000
# Image height or width in pixels: 4 × SDXL's 1024. One SD 1.5-sized row at 4096² holds 4 MiB of latents and a
# 192 MiB decoded image, and its UNet attends over 262144 tokens; larger is nothing these models generate.
MAX_IMAGE_SIDE = 4096
# Images one `diffrl sample` call writes (prompts × --num-images; `diffrl pairs sample`: 2 × --num-pairs). Each is
# generated, written and listed in scores.json (its record and seed held in memory until the end); 100000 are
# hours on a GPU for SD 1.5 and tens of GB of PNGs. The probe's `sample -n 1000000000` built its job list first and
# was killed by the kernel for memory before the first image.
MAX_IMAGES_PER_CALL = 100_000

# -- the demo only ----------------------------------------------------------------------------------------------------
# Images one demo request returns (Generate's images, Compare's prompts × images per prompt): each is decoded, kept
# as a PIL image and sent to the browser as a PNG (64 SD 1.5 images are 48 MiB of pixels, 192 MiB as floats).
MAX_DEMO_IMAGES = 64
# Uploads to the Score page: files per request, bytes per file (gradio's `max_file_size`, enforced while the upload
# arrives) and pixels per image (read from the header before decoding). An uncompressed 4096 × 4096 RGB image is
# 48 MiB, so every image within the pixel bound fits the byte bound; 4096² pixels are 201 MiB as the float tensor a
# reward scores (PIL's own decompression-bomb bound, 89 Mpx, would allow 1 GiB per image). The page scores one
# image at a time, so a request holds one image's tensor.
MAX_UPLOAD_FILES = 64
MAX_UPLOAD_BYTES = 64 * 2**20
MAX_UPLOAD_PIXELS = MAX_IMAGE_SIDE * MAX_IMAGE_SIDE


def check_method_sizes(method: str, config) -> None:
    """Each size setting of a method's config (`SIZE_BOUNDS`) in 1..bound, and its latent rows per prompt (the
    config's `latent_rows`) at most `MAX_LATENT_ROWS`."""
    for key, bound in SIZE_BOUNDS.items():
        value = getattr(config, key, None)
        if isinstance(value, int) and not 1 <= value <= bound:
            raise UserError(f"{method}'s {key} must be 1 to {bound} (per prompt), got {value}")
    rows = config.latent_rows
    if rows > MAX_LATENT_ROWS:
        raise UserError(f"{method} would hold {rows} latents per prompt at a step; keep it at most {MAX_LATENT_ROWS} "
                        f"({', '.join(f'{k}={getattr(config, k)}' for k in SIZE_BOUNDS if hasattr(config, k))})")


def check_call_rows(method: str, config, num_prompts: int, *, fewer: str = "fewer prompts per call") -> None:
    """The latent rows one steering call holds, `num_prompts` × the config's `latent_rows`, at most
    `MAX_ROWS_PER_CALL`; `fewer` says how to steer fewer prompts at once (a flag, or the demo's field)."""
    rows = num_prompts * config.latent_rows
    if rows > MAX_ROWS_PER_CALL:
        raise UserError(f"{method} would hold {num_prompts} prompts × {config.latent_rows} latents = {rows} latents "
                        f"at once, more than {MAX_ROWS_PER_CALL}; use {fewer} or a smaller budget")


def check_at_most(name: str, value: int, bound: int) -> None:
    """`value` (an int from a user) in 1..`bound`, else a `UserError` naming `name` and the bound."""
    if not 1 <= value <= bound:
        raise UserError(f"{name} must be 1 to {bound}, got {value}")
