"""The steering benchmark runs end to end on tiny random pipelines (a smoke test: the real numbers come from
`diffrl bench steer` on the ShapesWorld models)."""

import argparse
import json

import pytest

from diffrl.bench.steer import add_arguments, run_steer_bench, steer_bench


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from tiny_models import tiny_lcm_pipeline, tiny_sd_pipeline

    sd, lcm = tmp_path_factory.mktemp("sd"), tmp_path_factory.mktemp("lcm")
    tiny_sd_pipeline(sd)
    tiny_lcm_pipeline(lcm)
    prompts = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    prompts.write_text("a red circle\na blue square\na green triangle\n")
    return sd, lcm, prompts


def _args(folders, *extra):
    sd, lcm, prompts = folders
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([
        "--pipeline", str(sd), "--lcm-pipeline", str(lcm), "--reward", "steer_toy:brightness",
        "--grad-reward", "steer_toy:brightness", "--grad-reward-arg", "differentiable=true",
        "--eval-reward", "shapes_verifier", "--prompts", str(prompts), "--num-prompts", "2", "--budgets", "1,2",
        "--steps", "4", "--fk-interval", "1", "--reno-iterations-per-k", "2", "--prompts-per-call", "2",
        "--device", "cpu", *extra,
    ])


def test_bench_table_has_every_method_and_budget(folders):
    result = steer_bench(_args(folders), log=lambda line: None)
    rows = {(r["method"], r["k"]): r for r in result["rows"]}
    assert set(rows) == {(m, k) for m in ("best-of-n", "fk", "svdd", "guidance", "reno") for k in (1, 2)}
    # NFE per prompt at budget k with 4 steps: k chains of 4; SVDD 1 + 3k; ReNO 2k one-step generations
    expected = {"best-of-n": lambda k: 4 * k, "fk": lambda k: 4 * k, "svdd": lambda k: 1 + 3 * k,
                "guidance": lambda k: 4 * k, "reno": lambda k: 2 * k}
    for (method, k), row in rows.items():
        assert row["nfe_per_prompt"] == expected[method](k), (method, k)
        if method in ("fk", "svdd") and k == 1:  # nothing to choose between: only the final sample is scored
            assert row["reward_evals_per_prompt"] == 1
        assert 0 <= row["eval_mean"] <= 1 and row["eval_reward"] == "shapes_verifier"
        assert row["wall_s"] > 0 and 0 <= row["method_frac"] <= row["overhead_frac"] < 1
        assert row["overhead_s"] >= row["step_s"] > 0
    # without a k = 4 budget there is no FK gain to check, only the overhead
    assert set(result["targets"]) == {"max_overhead_frac"}


def test_bench_cli_entry_writes_json(folders, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert run_steer_bench(_args(folders, "--methods", "best-of-n,fk", "--budgets", "1,4", "--out", str(out))) == 0
    text = capsys.readouterr().out
    assert "fk_k4_gain_over_k1" in text and "max_overhead_frac" in text
    data = json.loads(out.read_text())
    assert len(data["rows"]) == 4 and "fk_k4_gain_over_k1" in data["targets"]


def test_reno_budget_matches_the_model_evaluations_of_the_others(folders):
    from diffrl.bench.steer import method_settings

    # by default a unit of budget is T model evaluations: T one-step generations (the paper's 50 at T = 50)
    args = _args(folders)
    args.reno_iterations_per_k = None
    assert method_settings("reno", 1, args) == {"iterations": 4}
    args.lcm_steps = 2
    assert method_settings("reno", 3, args) == {"iterations": 6}  # 2-step generations: T / 2 per unit
    args.reno_iterations_per_k = 5
    assert method_settings("reno", 2, args) == {"iterations": 10}


def test_guidance_guides_the_second_half_of_the_chain_by_default(folders):
    from diffrl.bench.steer import method_settings

    args = _args(folders)  # 4 steps
    assert method_settings("guidance", 2, args) == {"num_samples": 2, "scale": 1.0, "start": 2}
    args.guidance_start = 0
    assert method_settings("guidance", 1, args)["start"] == 0


def test_each_pipeline_is_steered_at_its_own_step_noise(folders, tmp_path):
    """DDIM at η = 1; a flow model at its SDE's noise level a = 0.7 (η = 1 would be the SDE's widest setting)."""
    from tiny_models import tiny_sd3_pipeline

    sd3 = tmp_path / "sd3"
    tiny_sd3_pipeline(sd3)
    for pipeline, eta in ((folders[0], 1.0), (sd3, 0.7)):
        args = _args(folders, "--methods", "fk", "--budgets", "2", "--pipeline", str(pipeline))
        (row,) = steer_bench(args, log=lambda line: None)["rows"]
        assert row["eta"] == eta, pipeline
