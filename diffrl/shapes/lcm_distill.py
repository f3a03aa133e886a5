"""Latent consistency distillation of tiny-shapes into tiny-shapes-lcm (Luo et al. 2023, "Latent Consistency
Models: Synthesizing High-Resolution Images with Few-Step Inference", Algorithm 1).

Notation (paper -> code):
    z_{t_{n+k}}           noisy         latents noised to timestep t (DDPM forward process)
    Ψ (ODE solver)        DDIM step of the teacher with classifier-free guidance, from t to t - k·(1000/N)
    ω                     w             guidance strength; the teacher uses ε_u + (1 + ω)(ε_c − ε_u)...
                                        written here as ε_c + ω(ε_c − ε_u), so the pipeline's guidance_scale = ω + 1
    f_θ(z, ω, c, t)       consistency function c_skip(t)·z + c_out(t)·x̂0(ε_θ(z, t, c, ω))
    θ⁻                    target        EMA of the student, decay `ema`
    d(·,·)                pseudo-Huber  sqrt(‖a − b‖² + c²) − c, per element mean

The student is the teacher's UNet with a guidance embedding (`time_cond_proj_dim`), its new input layer
initialised to zero, so it starts as the teacher. c_skip/c_out are the discrete boundary conditions of
diffusers' `LCMScheduler` (σ_data = 0.5, timestep_scaling = 10), so the exported model samples correctly
with `LatentConsistencyModelPipeline`.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from diffrl.embedded import ASSETS
from diffrl.shapes.models import SCHEDULER_CONFIG, make_unet
from diffrl.shapes.train_common import draw_encoded, encoded_train_set, frozen_parts, run_loop, save_fp16, tokenize

W_EMBED_DIM = 256
SIGMA_DATA = 0.5
TIMESTEP_SCALING = 10.0


def guidance_embedding(w, dim: int = W_EMBED_DIM):
    """Sinusoidal embedding of the guidance strength, the same function LatentConsistencyModelPipeline applies
    to (guidance_scale − 1) at inference: sin/cos of 1000·w at geometric frequencies."""
    import torch

    w = w.float() * 1000.0
    half = dim // 2
    freqs = torch.exp(torch.arange(half, dtype=torch.float32) * -(torch.log(torch.tensor(10000.0)) / (half - 1)))
    angles = w[:, None] * freqs[None, :]
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)


def boundary_scalings(t):
    """(c_skip, c_out) at integer timesteps t, as `LCMScheduler.get_scalings_for_boundary_condition_discrete`."""
    scaled = t.float() * TIMESTEP_SCALING
    c_skip = SIGMA_DATA**2 / (scaled**2 + SIGMA_DATA**2)
    c_out = scaled / (scaled**2 + SIGMA_DATA**2) ** 0.5
    return c_skip, c_out


def pred_x0(eps, x_t, alpha_bar_t):
    return (x_t - (1 - alpha_bar_t).sqrt() * eps) / alpha_bar_t.sqrt()


def _bc(v):
    return v.view(-1, 1, 1, 1)


def train_lcm(args):
    import torch
    from diffusers import DDPMScheduler, LCMScheduler, UNet2DConditionModel

    device = torch.device(args.device)
    teacher_dir = Path(args.teacher)
    tokenizer, text_encoder, vae = frozen_parts(teacher_dir / "text_encoder", teacher_dir / "vae",
                                               teacher_dir / "tokenizer")
    data = encoded_train_set(args, vae.to(device), tokenizer, text_encoder.to(device))
    teacher = UNet2DConditionModel.from_pretrained(teacher_dir / "unet", dtype=torch.float32).eval().to(device)
    teacher.requires_grad_(False)
    student = make_unet(time_cond_proj_dim=W_EMBED_DIM)
    missing, unexpected = student.load_state_dict(teacher.state_dict(), strict=False)
    assert not unexpected and all("cond_proj" in k for k in missing), (missing, unexpected)
    torch.nn.init.zeros_(student.time_embedding.cond_proj.weight)  # start as the teacher
    student.to(device)
    target = copy.deepcopy(student).requires_grad_(False)

    alphas_cumprod = DDPMScheduler.from_config(SCHEDULER_CONFIG).alphas_cumprod
    n_ddim = args.ddim_timesteps
    skip = SCHEDULER_CONFIG["num_train_timesteps"] // n_ddim
    ddim_t = torch.arange(1, n_ddim + 1) * skip - 1  # [N] the solver's grid: 19, 39, ..., 999
    with torch.no_grad():
        empty = text_encoder(tokenize(tokenizer, [""]).to(device))[0]

    def step_fn(step, gen):
        x0, cond = draw_encoded(data, args.batch_size, vae.config.scaling_factor, gen)
        b = len(x0)
        idx = torch.randint(0, n_ddim, (b,), generator=gen)
        t = ddim_t[idx]
        t_prev = (t - skip).clamp_min(0)
        a_t, a_prev = _bc(alphas_cumprod[t]), _bc(torch.where(t - skip >= 0, alphas_cumprod[t_prev],
                                                              torch.ones(())))
        noise = torch.randn(x0.shape, generator=gen)
        noisy = a_t.sqrt() * x0 + (1 - a_t).sqrt() * noise
        w = args.w_min + (args.w_max - args.w_min) * torch.rand(b, generator=gen)
        w_emb = guidance_embedding(w)
        # Every random draw above is made on the CPU generator; only the networks' work moves to `device`.
        x0, cond, t, t_prev, a_t, a_prev, noisy, w, w_emb = (
            v.to(device) for v in (x0, cond, t, t_prev, a_t, a_prev, noisy, w, w_emb))

        c_skip, c_out = (_bc(v) for v in boundary_scalings(t))
        eps = student(noisy, t, cond, timestep_cond=w_emb).sample
        prediction = c_skip * noisy + c_out * pred_x0(eps, noisy, a_t)

        with torch.no_grad():
            eps_both = teacher(torch.cat([noisy, noisy]), torch.cat([t, t]), torch.cat([cond, empty.expand_as(cond)])
                               ).sample
            eps_c, eps_u = eps_both.chunk(2)
            eps_cfg = eps_c + _bc(w) * (eps_c - eps_u)
            x0_teacher = pred_x0(eps_cfg, noisy, a_t)
            x_prev = a_prev.sqrt() * x0_teacher + (1 - a_prev).sqrt() * eps_cfg  # DDIM (eta = 0) step
            c_skip_p, c_out_p = (_bc(v) for v in boundary_scalings(t_prev))
            eps_target = target(x_prev, t_prev, cond, timestep_cond=w_emb).sample
            goal = c_skip_p * x_prev + c_out_p * pred_x0(eps_target, x_prev, a_prev)

        c = args.huber_c
        loss = (((prediction - goal) ** 2 + c**2).sqrt() - c).mean()
        return {"loss": loss}

    def after_step():
        with torch.no_grad():
            for p_t, p_s in zip(target.parameters(), student.parameters()):
                p_t.lerp_(p_s, 1 - args.target_ema)

    extra = {
        "load": lambda s: target.load_state_dict(s["target"]),
        "save": lambda s: s.update(target=target.state_dict()),
        "after_step": after_step,
    }

    def export():
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        save_fp16(target, out / "unet")
        LCMScheduler.from_config({**SCHEDULER_CONFIG, "timestep_scaling": TIMESTEP_SCALING,
                                  "original_inference_steps": n_ddim}).save_pretrained(out / "scheduler")
        # The text encoder, tokenizer and VAE are the teacher's: the folder names where to borrow them.
        source = "tiny-shapes" if teacher_dir.resolve() == (ASSETS / "tiny-shapes").resolve() else str(
            teacher_dir.resolve())
        index = {"_class_name": "LatentConsistencyModelPipeline", "_diffrl_components_from": source,
                 "scheduler": ["diffusers", "LCMScheduler"], "unet": ["diffusers", "UNet2DConditionModel"],
                 "text_encoder": ["transformers", "CLIPTextModel"], "tokenizer": ["transformers", "CLIPTokenizer"],
                 "vae": ["diffusers", "AutoencoderKL"], "safety_checker": [None, None],
                 "feature_extractor": [None, None], "image_encoder": [None, None], "requires_safety_checker": False}
        (out / "model_index.json").write_text(json.dumps(index, indent=2))

    run_loop(args, "lcm", {"student": student}, list(student.parameters()), step_fn, export, extra)
