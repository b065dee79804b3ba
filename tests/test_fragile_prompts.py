"""bench/studies/fragile_prompts.py: the protected variant of a configuration computes its first steps,
and the configurations it studies are the ones the trained page's budgeted mode ran."""

import csv

import pytest
import torch

from bench.studies import fragile_prompts as fp
from cache.flags import config_from_fields
from sampling.budget_space import static_fields


def test_protected_adds_the_first_steps_to_a_schedule_and_warms_up_a_threshold():
    static = static_fields([0, 1, 5, 9, 13, 17, 19])
    out = fp.protected(static, 4)
    assert out["deepcache"]["steps"] == [0, 1, 2, 3, 5, 9, 13, 17, 19]
    assert static["deepcache"]["steps"] == [0, 1, 5, 9, 13, 17, 19]  # the original kept
    tea = {"teacache": {"threshold": 3.0, "relative": True}}
    assert fp.protected(tea, 10)["warmup"] == 10 and "warmup" not in tea
    assert fp.protected(tea, 0) == tea
    for fields in (fp.protected(static, 4), fp.protected(tea, 10)):
        config_from_fields(fields)  # builds


def test_the_studied_configurations_are_what_the_trained_page_chose():
    page = fp.PROFILES["hunyuan"].replace("budget_profile_hunyuan.json", "results.csv")
    with open(page) as fh:
        ran = [r["setting"] for r in csv.DictReader(fh) if r["method"] == "ours budgeted"]
    assert [f"rel L2 budget {e:g}: {label}"
            for e, label in fp.chosen_labels(fp.PROFILES["hunyuan"])] == ran


def test_another_checkpoint_needs_the_profile_its_page_calibrated(capsys):
    with pytest.raises(SystemExit) as exc:
        fp.main(["--family", "wan", "--checkpoint", "bench/fixtures/heldout/tiny-wan-ti2v-seed7"])
    assert exc.value.code == 2 and "give --profile too" in capsys.readouterr().err


@pytest.mark.parametrize("more", ["-1", "21"])
def test_more_draws_must_be_a_count_of_unseen_draws(capsys, more):
    with pytest.raises(SystemExit) as exc:
        fp.main(["--family", "hunyuan", "--more", more])
    assert exc.value.code == 2 and f"--more {more}: expected a count of draws from 0 to 20" \
        in capsys.readouterr().err


def test_bf16_rounding_rounds_every_weight_and_restores_them_and_chaotic_draws_stand_out():
    from sampling.calibration import bf16_rounded
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0 + 2**-12, 2.0, 3.0], [0.1, 0.2, 0.3]]))
    before = [p.detach().clone() for p in model.parameters()]
    with bf16_rounded([model]):
        assert model.weight[0, 0].item() == 1.0  # 1 + 2^-12 is not a bf16 number
        assert all(torch.equal(p, p.to(torch.bfloat16).float()) for p in model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    errors = [2e-3, 1.9e-3, 2.8e-1, 2.4e-3, 3.8e-2, 1.7e-3, 9e-3]  # draw 63 and 71's kind
    assert fp.chaotic([10, 11, 63, 12, 71, 13, 14], errors) == {63, 71}


def test_beyond_draws_follow_every_draw_the_calibration_saw():
    confirmed = {"seeds": [1, 2, 3], "screen_seeds": list(range(34, 64)),
                 "confirm_seeds": list(range(84, 204))}
    assert fp.beyond_draws(confirmed, 3) == [204, 205, 206]
    # an older profile (confirmed on fewer draws, or not at all) still starts after the default
    # confirm draws, so none meets a draw --more or a newer calibration takes
    assert fp.beyond_draws({"seeds": [1, 2, 3], "screen_seeds": list(range(34, 64))}, 2) \
        == [fp.CONFIRM_SEEDS[-1] + 1, fp.CONFIRM_SEEDS[-1] + 2]
    assert fp.beyond_draws(confirmed, 0) == []


def test_beyond_must_be_a_count(capsys):
    with pytest.raises(SystemExit) as exc:
        fp.main(["--family", "hunyuan", "--beyond", "-2"])
    assert exc.value.code == 2 and "--beyond -2: expected a count of draws >= 0" \
        in capsys.readouterr().err
