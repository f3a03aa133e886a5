"""CADS in steering (`diffrl/steering/cads.py`): γ ≡ 1 is plain steering exactly, each particle's condition noise is
keyed by (seed, CADS seed, particle slot, step), FK's copies and SVDD's candidates get the noise the module says,
and `diffrl steer --cads` / the recipe's `cads:` parse strictly."""

import json
import math

import numpy as np
import pytest
import torch
from cli_helpers import one_line_error
from PIL import Image
from steer_toy import Brightness
from tiny_models import tiny_sd_pipeline

from diffrl.cli import main
from diffrl.errors import UserError
from diffrl.steering import steer
from diffrl.steering.recipe import recipe_from_dict
from samplers.cads import CADSConfig

PROMPTS = ["a red circle", "a blue square"]
OFF = CADSConfig(tau1=1.0, tau2=1.0)  # γ(t) = 1 for every t ≤ 1: CADS never acts
# s = 1, ψ = 0 (no rescaling), τ1 = 0, τ2 = 1: γ(t) = 1 − t and ŷ = √(1 − t)·y + √t·n, so n = (ŷ − √(1 − t)·y) / √t
LINEAR = CADSConfig(tau1=0.0, tau2=1.0, noise_scale=1.0, mix=0.0)


class Recorder:
    """Stands in for a process's model family and keeps the conditioning and timestep of every model call."""

    def __init__(self, family):
        self._family = family
        self.calls = []  # (t normalised to [0, 1], Conditioning of the call's rows)

    def __getattr__(self, name):
        return getattr(self._family, name)

    def model_output(self, x, t, cond, *args, **kwargs):
        self.calls.append((float(t) / 1000, cond))
        return self._family.model_output(x, t, cond, *args, **kwargs)


def _recorded(pipe, method, seed=0, cads=LINEAR, **cfg):
    """Run `steer` with a recorder on its process; returns (images, info, recorder, process)."""
    seen = {}

    def wrap(process):
        seen["process"] = process
        process.family = seen["recorder"] = Recorder(process.family)
        return process

    images, _, info = steer(pipe, PROMPTS, Brightness(), method, num_steps=5, seed=seed, cads=cads,
                            process_wrapper=wrap, **cfg)
    return images, info, seen["recorder"], seen["process"]


def _noise(call, process, rows_cond):
    """The condition noise n of each row of a recorded call under `LINEAR` (see above), `[N, L, D]`."""
    t, cond = call
    y = process.cond.prompt_embeds[rows_cond]
    return (cond.prompt_embeds - math.sqrt(1 - t) * y) / math.sqrt(t)


def _expected_noise(seed, cads_seed, slot, step, shape):
    """Worked from the documented key, outside the code under test: NumPy's SeedSequence of
    (seed, CADS seed, slot, step) → two 32-bit words → a 63-bit torch seed → one standard normal draw."""
    words = np.random.SeedSequence([seed, cads_seed, slot, step]).generate_state(2, np.uint32)
    generator = torch.Generator().manual_seed(int(words[0]) | (int(words[1]) & 0x7FFFFFFF) << 32)
    return torch.randn((1, *shape), generator=generator)[0]


# -- γ ≡ 1 is plain steering; CADS on is seeded ------------------------------------------------------------


@pytest.mark.parametrize("family", ["ddim", "flow"])
@pytest.mark.parametrize(("method", "cfg"), [("best-of-n", {"num_samples": 3}),
                                             ("fk", {"num_particles": 3, "interval": 1, "lmbda": 10.0})])
def test_gamma_one_is_plain_steering_exactly_and_cads_on_is_seeded(family, method, cfg, tiny_sd, tiny_sd3):
    pipe = {"ddim": tiny_sd, "flow": tiny_sd3}[family]
    settings = {"num_steps": 5, "seed": 3, **cfg}
    plain, plain_scores, plain_info = steer(pipe, PROMPTS, Brightness(), method, **settings)
    off, off_scores, off_info = steer(pipe, PROMPTS, Brightness(), method, cads=OFF, **settings)
    assert torch.equal(off, plain) and torch.equal(off_scores, plain_scores)
    assert plain_info["cads"] is None and off_info["cads"]["tau1"] == 1.0
    on, _, on_info = steer(pipe, PROMPTS, Brightness(), method, cads="on", **settings)
    assert on_info["cads"] == {"tau1": 0.6, "tau2": 0.9, "noise_scale": 0.25, "mix": 1.0, "seed": 0}
    assert (on - plain).abs().amax() > 1e-3  # CADS acts (the tiny models move by 0.02–0.7 here)
    again, _, _ = steer(pipe, PROMPTS, Brightness(), method, cads="on", **settings)
    assert torch.equal(again, on)  # same seed → same images
    other_seed, _, _ = steer(pipe, PROMPTS, Brightness(), method, cads="on", **{**settings, "seed": 4})
    other_cads_seed, _, _ = steer(pipe, PROMPTS, Brightness(), method, cads="seed=1", **settings)
    plain_other_seed, _, _ = steer(pipe, PROMPTS, Brightness(), method, **{**settings, "seed": 4})
    assert not torch.equal(other_seed, on) and not torch.equal(other_cads_seed, on)
    assert not torch.equal(other_seed, plain_other_seed)


# -- whose noise a row gets --------------------------------------------------------------------------------


def test_each_particle_has_its_own_noise_keyed_by_slot_and_step_through_fk_resampling(tiny_sd):
    k = 3
    _, fk_info, fk, process = _recorded(tiny_sd, "fk", num_particles=k, interval=1, lmbda=1000.0, adaptive=False)
    assert sum(groups for _, groups in fk_info["resample_steps"]) > 0  # resampled (every scheduled step here)
    _, _, bon, _ = _recorded(tiny_sd, "best-of-n", num_samples=k)
    rows_cond = torch.arange(len(PROMPTS)).repeat_interleave(k)
    assert len(fk.calls) == len(bon.calls) == 5  # one model call per step: copies are not re-evaluated
    for step, (fk_call, bon_call) in enumerate(zip(fk.calls, bon.calls)):
        n = _noise(fk_call, process, rows_cond)  # [6, 77, 32]
        # every particle of the call has its own draw
        for a in range(len(n)):
            for b in range(a):
                assert (n[a] - n[b]).abs().amax() > 0.5
        assert 0.9 < float(n.std()) < 1.1  # standard normal (77·32 entries a row)
        # FK resampled its particles, yet slot j's noise at this step is best-of-N's slot j's: it is keyed by the
        # slot and the step, not by ancestry
        torch.testing.assert_close(n, _noise(bon_call, process, rows_cond), atol=1e-4, rtol=0)
    # and it is the documented key's draw: seed 0, CADS seed 0, slot 4, step 2
    torch.testing.assert_close(_noise(fk.calls[2], process, rows_cond)[4],
                               _expected_noise(0, 0, 4, 2, (77, 32)), atol=1e-4, rtol=0)


def test_svdd_candidates_share_their_chains_noise(tiny_sd):
    m = 3
    _, _, rec, process = _recorded(tiny_sd, "svdd", num_candidates=m)
    # step 0: the two chains (one per prompt); steps 1–4: their 3 candidates each
    assert [len(cond.prompt_embeds) for _, cond in rec.calls] == [2, 6, 6, 6, 6]
    for step, call in enumerate(rec.calls[1:], start=1):
        n = _noise(call, process, torch.arange(2).repeat_interleave(m)).view(2, m, 77, 32)
        for chain in range(2):
            for j in range(1, m):
                torch.testing.assert_close(n[chain, j], n[chain, 0], atol=1e-4, rtol=0)
        assert (n[0, 0] - n[1, 0]).abs().amax() > 0.5
        torch.testing.assert_close(n[1, 0], _expected_noise(0, 0, 1, step, (77, 32)), atol=1e-4, rtol=0)


def test_guidance_rows_keep_their_slots_when_evaluated_one_at_a_time(tiny_sd):
    # guidance evaluates chunks of rows with a graph; were a chunk's rows numbered from 0, every row of a
    # one-row chunk would get slot 0's noise and the images would change
    settings = {"num_steps": 4, "seed": 2, "cads": "on", "num_samples": 2, "scale": 1.0}
    together, _, _ = steer(tiny_sd, PROMPTS, Brightness(), "guidance", **settings)
    one_by_one, _, _ = steer(tiny_sd, PROMPTS, Brightness(), "guidance", batch_size=1, **settings)
    plain, _, _ = steer(tiny_sd, PROMPTS, Brightness(), "guidance", **{**settings, "cads": None})
    torch.testing.assert_close(one_by_one, together, atol=1e-5, rtol=0)
    assert (together - plain).abs().amax() > 1e-3


def test_reno_sees_the_same_condition_noise_at_every_iteration(tiny_sd3):
    seen = {}

    def wrap(process):
        process.family = seen["recorder"] = Recorder(process.family)
        return process

    steer(tiny_sd3, PROMPTS, Brightness(), "reno", num_steps=3, cads="on", iterations=3, process_wrapper=wrap)
    calls = seen["recorder"].calls
    assert len(calls) == 3 * 3
    for step in range(3):
        first = calls[step][1].prompt_embeds
        assert all(torch.equal(calls[3 * it + step][1].prompt_embeds, first) for it in (1, 2))


def test_a_chain_that_never_sees_its_prompt_is_refused(tiny_lcm):
    # ReNO's default chain on an LCM is one step at t = 999/1000 ≥ τ2 = 0.9: γ = 0, the prompt is noise only
    with pytest.raises(UserError, match="replaces the prompt with noise at every one") as info:
        steer(tiny_lcm, PROMPTS, Brightness(), "reno", cads="on", iterations=2)
    assert "\n" not in str(info.value)
    # τ2 = 1: γ(0.999) = 0.001 / 0.4 > 0, allowed
    _, _, info = steer(tiny_lcm, PROMPTS, Brightness(), "reno", cads="tau2=1", iterations=2)
    assert info["num_steps"] == 1 and info["cads"]["tau2"] == 1.0


# -- diffrl steer --cads and the recipe's cads ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-sd")
    tiny_sd_pipeline(folder)
    return folder


def _argv(folder, out, *extra):
    return ["steer", "--pipeline", str(folder), "--method", "fk", "--reward", "steer_toy:brightness",
            "--prompt", "a red circle", "--prompt", "a blue square", "--steps", "4", "--set", "num_particles=2",
            "--set", "interval=1", "--device", "cpu", "--out", str(out), *extra]


def test_steer_cli_cads(tiny_folder, tmp_path):
    images = {}
    for name, extra in {"plain": [], "off": ["--cads", "tau1=1,tau2=1"], "on": ["--cads", "tau1=0.5,seed=3"]}.items():
        assert main(_argv(tiny_folder, tmp_path / name, *extra)) == 0
        images[name] = [np.asarray(Image.open(tmp_path / name / f"0000{i}.png")) for i in range(2)]
    assert all(np.array_equal(a, b) for a, b in zip(images["plain"], images["off"]))
    assert not all(np.array_equal(a, b) for a, b in zip(images["plain"], images["on"]))
    settings = json.loads((tmp_path / "on" / "settings.json").read_text())
    expected = {"tau1": 0.5, "tau2": 0.9, "noise_scale": 0.25, "mix": 1.0, "seed": 3}
    assert settings["recipe"]["cads"] == expected and settings["per_call"][0]["cads"] == expected
    assert json.loads((tmp_path / "plain" / "settings.json").read_text())["recipe"]["cads"] is None


def test_steer_cli_cads_off_overrides_a_recipes_cads(tiny_folder, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"method: best-of-n\npipeline: {tiny_folder}\nreward: steer_toy:brightness\n"
                      "prompts: [a red circle]\nsample: {num_steps: 3}\nsteer: {num_samples: 2}\ncads: {tau1: 0.5}\n")
    assert main(["steer", "--recipe", str(recipe), "--out", str(tmp_path / "a")]) == 0
    assert json.loads((tmp_path / "a" / "settings.json").read_text())["recipe"]["cads"]["tau1"] == 0.5
    assert main(["steer", "--recipe", str(recipe), "--cads", "off", "--out", str(tmp_path / "b")]) == 0
    assert json.loads((tmp_path / "b" / "settings.json").read_text())["recipe"]["cads"] is None


@pytest.mark.parametrize(("value", "expected"), [
    ("tau1=0.95", "tau1 <= tau2"), ("tau=0.5", "is not one of tau1="), ("mix=x", "mix='x' is not a number"),
    ("noise_scale=-0.1", "noise_scale must be >= 0"), ("seed=1.5", "seed='1.5' is not a number"),
])
def test_steer_cli_bad_cads_is_one_line_and_writes_nothing(tiny_folder, tmp_path, capsys, value, expected):
    one_line_error(capsys, _argv(tiny_folder, tmp_path / "out", "--cads", value), expected, tmp_path)
    assert not (tmp_path / "out").exists()


def test_recipe_cads_forms():
    good = {"method": "fk", "pipeline": "tiny-shapes", "reward": "shapes_verifier", "prompts": "shapes:heldout"}
    assert recipe_from_dict(good).cads is None
    assert recipe_from_dict({**good, "cads": "on"}).cads == CADSConfig()
    assert recipe_from_dict({**good, "cads": True}).cads == CADSConfig()
    assert recipe_from_dict({**good, "cads": "off"}).cads is None
    assert recipe_from_dict({**good, "cads": {"tau1": 0.5, "seed": 2}}).cads == CADSConfig(tau1=0.5, seed=2)
    assert recipe_from_dict({**good, "cads": "tau2=0.8,mix=0"}).cads == CADSConfig(tau2=0.8, mix=0.0)
    for bad, message in [({"tua1": 1}, "did you mean 'tau1'"), ({"seed": 1.5}, "cads.seed must be an integer"),
                         ({"mix": "x"}, "cads.mix must be a finite number"), (3, "cads must be on, off"),
                         ({"tau1": 0.95}, "tau1 <= tau2")]:
        with pytest.raises(UserError, match=message) as info:
            recipe_from_dict({**good, "cads": bad})
        assert "\n" not in str(info.value)


# -- diffrl bench cads -------------------------------------------------------------------------------------


def _bench(folder, out, *extra):
    return ["bench", "cads", "--pipeline", str(folder), "-n", "2", "--num-prompts", "2", "--steps", "3",
            "--guidance", "4", "--device", "cpu", "--threads", "1", "--out", str(out), *extra]


@pytest.mark.parametrize("method", ["sample", "fk"])
def test_bench_cads_with_gamma_one_has_zero_differences(tiny_folder, tmp_path, capsys, method):
    extra = ["--method", "fk", "--set", "num_particles=2", "--set", "interval=1"] if method == "fk" else []
    assert main(_bench(tiny_folder, tmp_path / "r.json", "--cads", "tau1=1,tau2=1", *extra)) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    rows = result["rows"]
    assert [(r["method"], r["guidance_scale"], r["cads"] is None) for r in rows] == [(method, 4.0, True),
                                                                                     (method, 4.0, False)]
    assert all(r["images"] == 4 and len(r["diversity_per_prompt"]) == 2 for r in rows)
    if method == "fk":
        assert all(r["nfe_per_image"] == 2 * 3 and r["eta"] == 1.0 for r in rows)  # 2 particles × 3 steps
    # γ ≡ 1: the same images with and without, so every paired difference and its s.e. is exactly 0
    (diff,) = result["differences"]
    assert diff["diversity_diff"] == [0.0, 0.0] and diff["verifier_diff"] == [0.0, 0.0]
    assert rows[0]["diversity"] == rows[1]["diversity"] > 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 3  # one JSON line per row and per difference


@pytest.mark.parametrize(("extra", "expected"), [
    (["--cads", "tau1=2"], "tau1 <= tau2"),
    (["--method", "fk", "--set", "num_particle=2"], "did you mean 'num_particles'"),
    (["--set", "num_samples=2"], "plain sampling (--method sample) has none"),
    (["-n", "1"], "-n must be at least 2"),
    (["--method", "fkk"], "invalid choice"),
])
def test_bench_cads_bad_input_is_one_line(tiny_folder, tmp_path, capsys, extra, expected):
    one_line_error(capsys, _bench(tiny_folder, tmp_path / "r.json", *extra), expected, tmp_path)
