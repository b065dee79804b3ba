"""bench/fragile_prompts.py: the protected variant of a configuration computes its first steps,
and the configurations it studies are the ones the trained page's budgeted mode ran."""

import csv

import pytest

from bench import fragile_prompts as fp
from cache.flags import config_from_fields
from sampling.budget import static_fields


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


def test_more_draws_must_be_a_count(capsys):
    with pytest.raises(SystemExit) as exc:
        fp.main(["--family", "hunyuan", "--more", "-1"])
    assert exc.value.code == 2 and "--more -1" in capsys.readouterr().err
