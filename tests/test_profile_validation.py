"""Calibrated profiles are checked field by field on load (issue 23, item 6 and the poly profile
of item 8): a budget profile (`--budget_profile`, sampling/budget.py) and a TeaCache poly profile
(`--teacache_policy poly:<file>`, cache/teacache_profiles.py). Each tampering of a profile that
`python -m commands.calibrate --budget` really wrote is refused in one line naming the file, the
field (its path in the file) and what was expected; the commands print that line, exit 2 and
write nothing."""

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import stage2_transformer_flax_deepcache as stage2
from cache import ConfigError, TeaCacheConfig
from cache.teacache_profiles import PolyProfile, ProfileError, load_profile_file
from commands import calibrate
from sampling import budget, budget_profile, budget_space, calibration
from sampling.budget import BudgetError

ROOT = Path(__file__).resolve().parents[1]
MODEL, STEPS = "wan-tiny-i2v", 8  # two experts: the per-expert fields are written too
SMALL_SPACE = (  # two configurations of the shipped space, so the calibration stays short
    ("FBCache 0.05", {"fbcache": {"threshold": 0.05, "metric": "residual_tensor_rel_l1"}}),
    ("TeaCache relative 3", {"teacache": {"threshold": 3.0, "relative": True}}),
)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A profile as `python -m commands.calibrate --budget` writes it (the real writer)."""
    path = tmp_path_factory.mktemp("calibrated") / "profile.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(budget_space, "space", lambda *_: SMALL_SPACE)
        assert calibrate.main(["--model", MODEL, "--samples", "2", "--num_inference_steps",
                               str(STEPS), "--degree", "2", "--budget", "--out", str(path)]) == 0
    profile = json.loads(path.read_text())
    assert set(profile["experts"]) == set(profile["experts_rel_range"]) == {"high", "low"}
    assert len(profile["budget"]["candidates"]) == len(SMALL_SPACE)
    return profile


def tampered(tmp_path, profile, change, name="tampered.json"):
    """The profile with `change` applied, written to a file; its path."""
    profile = copy.deepcopy(profile)
    change(profile)
    path = tmp_path / name
    path.write_text(json.dumps(profile))
    return str(path)


def one_line(exc) -> str:
    text = str(exc)
    assert "\n" not in text and "Traceback" not in text, text
    return text


# --- the round trip --------------------------------------------------------------------------------

def test_a_freshly_written_profile_loads_as_both_kinds(tmp_path, written):
    path = tampered(tmp_path, written, lambda p: None)
    measured = budget_profile.load(path)
    assert measured == written["budget"]
    profile = load_profile_file(path)
    assert profile.coefficients == tuple(written["coefficients"])
    assert profile.experts == {k: tuple(v) for k, v in written["experts"].items()}
    assert profile.expert_ranges == {k: tuple(v) for k, v in written["experts_rel_range"].items()}
    assert profile.rel_range == tuple(written["rel_range"])
    assert (profile.signal, profile.threshold, profile.warmup, profile.source) == (
        written["signal"], written["threshold"], written["warmup"], written["source"])
    assert TeaCacheConfig(policy=f"poly:{path}").profile == profile


def test_the_shipped_budget_profiles_load():
    for family in ("wan", "hunyuan"):
        measured = budget_profile.load(str(ROOT / f"bench/results/pareto/budget_profile_{family}.json"))
        # every shipped configuration was measured (the static schedules came later: issue 39)
        assert {label for label, _ in budget_space.SPACE} <= {c["label"] for c in measured["candidates"]}


@pytest.mark.parametrize("change", [
    pytest.param(lambda p: p.update(rel_range=None, experts_rel_range={}), id="no fitted range"),
    pytest.param(lambda p: [p.pop(k) for k in ("threshold", "warmup", "source", "experts", "r2",
                                               "points", "experts_r2", "rel_range",
                                               "experts_rel_range", "budget")], id="only required"),
    pytest.param(lambda p: p.update(extra={"note": 1}), id="a key of its own"),
])
def test_what_the_poly_format_leaves_optional_loads(tmp_path, written, change):
    assert isinstance(load_profile_file(tampered(tmp_path, written, change)), PolyProfile)


def test_a_diverged_draw_is_a_valid_measurement_that_choose_leaves_out(tmp_path, written):
    """calibrate writes NaN or Infinity where a configuration's run diverged."""
    def diverge(p):
        p["budget"]["candidates"][1]["rel_l2"][0] = float("nan")
        p["budget"]["candidates"][0]["rel_l2"][1] = float("inf")
    measured = budget_profile.load(tampered(tmp_path, written, diverge))
    assert math.isnan(measured["candidates"][1]["rel_l2"][0])
    assert budget.choose(measured, rel_err=1e9) is None
    assert budget.pooled_spread(measured["candidates"]) == 0.0  # no finite spread to pool


# --- budget profiles -----------------------------------------------------------------------------

def _set(*keys_and_value):
    *keys, value = keys_and_value

    def change(p):
        node = p
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value
    return change


def _drop(*keys):
    def change(p):
        node = p
        for k in keys[:-1]:
            node = node[k]
        del node[keys[-1]]
    return change


B, C0, C1 = ("budget",), ("budget", "candidates", 0), ("budget", "candidates", 1)

BUDGET_CASES = [  # (id, change, the field named, what it says it expected)
    ("negative rel_l2", _set(*C1, "rel_l2", 0, -0.5), "budget.candidates[1].rel_l2[0] -0.5",
     "a relative L2 error >= 0"),
    ("-Infinity rel_l2", _set(*C1, "rel_l2", 1, -math.inf), "budget.candidates[1].rel_l2[1] -inf",
     ">= 0"),
    ("string rel_l2", _set(*C1, "rel_l2", 0, "0.001"), "budget.candidates[1].rel_l2[0] '0.001'",
     ">= 0"),
    ("boolean rel_l2", _set(*C1, "rel_l2", 0, True), "budget.candidates[1].rel_l2[0] true", ">= 0"),
    ("rel_l2 per draw", _set(*C1, "rel_l2", [1e-3]), "budget.candidates[1].rel_l2 [0.001]",
     "2 relative L2 errors, one per draw"),
    ("rel_l2 not a list", _set(*C1, "rel_l2", 1e-3), "budget.candidates[1].rel_l2 0.001",
     "one per draw"),
    ("negative computed", _set(*C1, "computed", 0, -0.5), "budget.candidates[1].computed[0] -0.5",
     "in [0, 1]"),
    ("computed above 1", _set(*C1, "computed", 1, 1.5), "budget.candidates[1].computed[1] 1.5",
     "in [0, 1]"),
    ("NaN computed", _set(*C1, "computed", 0, math.nan), "budget.candidates[1].computed[0] nan",
     "in [0, 1]"),
    ("string computed", _set(*C1, "computed", 0, "0.5"), "budget.candidates[1].computed[0] '0.5'",
     "in [0, 1]"),
    ("computed per draw", _set(*C1, "computed", [0.5, 0.5, 0.5]), "budget.candidates[1].computed",
     "2 computed fractions"),
    ("steps a string", _set(*B, "steps", "6"), "budget.steps '6'", "an integer >= 1"),
    ("steps a float", _set(*B, "steps", 8.0), "budget.steps 8.0", "an integer >= 1"),
    ("steps a boolean", _set(*B, "steps", True), "budget.steps true", "an integer >= 1"),
    ("steps 0", _set(*B, "steps", 0), "budget.steps 0", "an integer >= 1"),
    ("model a number", _set(*B, "model", 5), "budget.model 5", "a non-empty string"),
    ("model empty", _set(*B, "model", ""), "budget.model ''", "a non-empty string"),
    ("seeds a string", _set(*B, "seeds", "0,1"), "budget.seeds '0,1'", "at least 2 draws"),
    ("one seed", _set(*B, "seeds", [0]), "budget.seeds [0]", "at least 2 draws"),
    ("seed a string", _set(*B, "seeds", 1, "1"), "budget.seeds[1] '1'", "an integer"),
    ("seeds repeated", _set(*B, "seeds", [3, 3]), "budget.seeds [3, 3]", "distinct seeds"),
    ("format 1", _set(*B, "format", 1), "budget.format 1", "expected 2"),
    ("format a string", _set(*B, "format", "2"), "budget.format '2'", "expected 2"),
    ("format a float", _set(*B, "format", 2.0), "budget.format 2.0", "expected 2"),
    ("solver unknown", _set(*B, "solver", "rk4"), "budget.solver 'rk4'", "one of 'euler'"),
    ("solver a number", _set(*B, "solver", 1), "budget.solver 1", "one of 'euler'"),
    ("shift a string", _set(*B, "shift", "5"), "budget.shift '5'", "a finite number > 0"),
    ("shift 0", _set(*B, "shift", 0), "budget.shift 0", "a finite number > 0"),
    ("shift NaN", _set(*B, "shift", math.nan), "budget.shift nan", "a finite number > 0"),
    ("pooled spread negative", _set(*B, "pooled_log_spread", -1.0), "budget.pooled_log_spread -1.0",
     "a finite number >= 0"),
    ("pooled spread Infinity", _set(*B, "pooled_log_spread", math.inf),
     "budget.pooled_log_spread inf", "a finite number >= 0"),
    ("candidates an object", _set(*B, "candidates", {}), "budget.candidates {}",
     "a non-empty array of measured configurations"),
    ("no candidates", _set(*B, "candidates", []), "budget.candidates []", "a non-empty array"),
    ("candidate a list", _set(*C0, []), "budget.candidates[0] []", "an object: label, config"),
    ("label a number", _set(*C0, "label", 3), "budget.candidates[0].label 3", "a non-empty string"),
    ("config a list", _set(*C0, "config", [1, 2]), "budget.candidates[0].config [1, 2]",
     "an object, a partial CMConfig"),
    ("config section a number", _set(*C0, "config", {"fbcache": 5}),
     "budget.candidates[0].config: fbcache 5", "an object of FBCacheConfig fields"),
    ("config unknown field", _set(*C0, "config", {"fbcache": {"treshold": 0.1}}),
     "budget.candidates[0].config: fbcache sets unknown fields ['treshold']", "expected fields"),
    ("config negative threshold", _set(*C0, "config", "fbcache", "threshold", -0.1),
     "budget.candidates[0].config: FBCacheConfig.threshold", ">= 0"),
    ("config policy a number", _set(*C1, "config", "teacache", "policy", 1),
     "budget.candidates[1].config: TeaCacheConfig.policy", "'linear' or 'poly:<profile>'"),
    ("config order a number", _set(*C0, "config", "evaluation_order", 1),
     "budget.candidates[0].config: CMConfig.evaluation_order", "distinct modes"),
    ("config noise_adapt a number", _set(*C0, "config", "noise_adapt", 1),
     "budget.candidates[0].config: noise_adapt must be", "table:<name>"),
    ("budget a list", _set("budget", [1]), "budget [1]", "the budget measured by"),
    ("budget null", _set("budget", None), "budget null", "the budget measured by"),
] + [(f"no {key}", _drop(*B, key), f"budget.{key} is missing", "expected")
     for key in ("format", "model", "seeds", "steps", "candidates")] + [
    (f"no candidate {key}", _drop(*C1, key), f"budget.candidates[1].{key} is missing", "expected")
    for key in ("label", "config", "rel_l2", "computed")]


@pytest.mark.parametrize("change, field, expected", [c[1:] for c in BUDGET_CASES],
                         ids=[c[0] for c in BUDGET_CASES])
def test_a_tampered_budget_profile_is_refused_naming_the_field(tmp_path, written, change, field,
                                                               expected):
    path = tampered(tmp_path, written, change)
    with pytest.raises(BudgetError) as refused:
        budget_profile.load(path)
    message = one_line(refused.value)
    assert message.startswith(f"--budget_profile {path}: {field}"), message
    assert expected in message.split(field, 1)[1], message


# --- TeaCache poly profiles -----------------------------------------------------------------------

POLY_CASES = [
    ("experts a list", _set("experts", [1, 2]), "experts [1, 2]",
     "an object mapping each expert's name to its coefficients"),
    ("expert coefficients a string", _set("experts", "high", "x"), "experts.high 'x'",
     "a non-empty array of finite numbers"),
    ("expert coefficients empty", _set("experts", "high", []), "experts.high []",
     "a non-empty array"),
    ("expert coefficient NaN", _set("experts", "low", 0, math.nan), "experts.low[0] nan",
     "a finite number"),
    ("expert name empty", _set("experts", "", [1.0]), 'experts[""] [1.0]',
     "a non-empty expert name"),
    ("coefficients a string", _set("coefficients", "1 2 3"), "coefficients '1 2 3'",
     "a non-empty array of finite numbers"),
    ("coefficients empty", _set("coefficients", []), "coefficients []", "a non-empty array"),
    ("coefficient a string", _set("coefficients", 1, "2"), "coefficients[1] '2'",
     "a finite number"),
    ("coefficient a boolean", _set("coefficients", 0, False), "coefficients[0] false",
     "a finite number"),
    ("coefficient NaN", _set("coefficients", 2, math.nan), "coefficients[2] nan", "a finite number"),
    ("coefficient Infinity", _set("coefficients", 0, math.inf), "coefficients[0] inf",
     "a finite number"),
    ("signal unknown", _set("signal", "latent"), "signal 'latent'", "one of 'modulated_input'"),
    ("signal a number", _set("signal", 0), "signal 0", "one of 'modulated_input'"),
    ("threshold negative", _set("threshold", -0.1), "threshold -0.1", "a finite number >= 0"),
    ("threshold a string", _set("threshold", "0.15"), "threshold '0.15'", "a finite number >= 0"),
    ("threshold NaN", _set("threshold", math.nan), "threshold nan", "a finite number >= 0"),
    ("warmup negative", _set("warmup", -1), "warmup -1", "an integer >= 0"),
    ("warmup a float", _set("warmup", 1.5), "warmup 1.5", "an integer >= 0"),
    ("warmup a string", _set("warmup", "1"), "warmup '1'", "an integer >= 0"),
    ("warmup a boolean", _set("warmup", True), "warmup true", "an integer >= 0"),
    ("source a number", _set("source", 5), "source 5", "a non-empty string"),
    ("rel_range one value", _set("rel_range", [0.1]), "rel_range [0.1]", "[low, high]"),
    ("rel_range reversed", _set("rel_range", [0.2, 0.1]), "rel_range [0.2, 0.1]", "low <= high"),
    ("rel_range negative", _set("rel_range", [-0.1, 0.1]), "rel_range[0] -0.1", "0 <= low"),
    ("rel_range Infinity", _set("rel_range", [0.0, math.inf]), "rel_range[1] inf", "finite"),
    ("rel_range a string", _set("rel_range", "0-1"), "rel_range '0-1'", "[low, high]"),
    ("expert range a list", _set("experts_rel_range", [[0, 1]]), "experts_rel_range [[0, 1]]",
     "an object mapping each expert's name to its fitted rel range"),
    ("expert range of no expert", _set("experts_rel_range", "mid", [0.0, 1.0]),
     "experts_rel_range.mid [0.0, 1.0]", "only for an expert with coefficients"),
    ("expert range reversed", _set("experts_rel_range", "high", [1.0, 0.0]),
     "experts_rel_range.high [1.0, 0.0]", "low <= high"),
    ("r2 a string", _set("r2", "0.9"), "r2 '0.9'", "a finite number"),
    ("r2 NaN", _set("r2", math.nan), "r2 nan", "a finite number"),
    ("points 0", _set("points", 0), "points 0", "an integer >= 1"),
    ("points a string", _set("points", "24"), "points '24'", "an integer >= 1"),
    ("experts_r2 a list", _set("experts_r2", [0.9]), "experts_r2 [0.9]", "an object mapping"),
    ("expert r2 a string", _set("experts_r2", "high", "x"), "experts_r2.high 'x'",
     "a finite number"),
    ("no coefficients", _drop("coefficients"), "coefficients is missing", "a non-empty array"),
    ("no signal", _drop("signal"), "signal is missing", "one of 'modulated_input'"),
]


@pytest.mark.parametrize("change, field, expected", [c[1:] for c in POLY_CASES],
                         ids=[c[0] for c in POLY_CASES])
def test_a_tampered_poly_profile_is_refused_naming_the_field(tmp_path, written, change, field,
                                                             expected):
    path = tampered(tmp_path, written, change)
    with pytest.raises(ProfileError) as refused:
        load_profile_file(path)
    message = one_line(refused.value)
    assert message.startswith(f"TeaCache profile {path}: {field}"), message
    assert expected in message.split(field, 1)[1], message
    with pytest.raises(ConfigError, match="--teacache_policy|TeaCache profile"):  # as a policy
        TeaCacheConfig(policy=f"poly:{path}")


# --- files that are no profile at all: both loaders ------------------------------------------------

def _bytes(data):
    return lambda path: path.write_bytes(data)


FILE_CASES = [
    ("not UTF-8", _bytes(b'{"signal": "\xff\xfe"}'), "is not UTF-8 text (byte 12"),
    ("not JSON", _bytes(b"coefficients: [1, 2]"), "is not valid JSON (Expecting value"),
    ("empty", _bytes(b""), "is not valid JSON"),
    ("nested 100k deep", _bytes(b"[" * 100_000 + b"]" * 100_000), "is JSON nested too deeply"),
    ("an integer of 5000 digits", _bytes(b"1" * 5000), "is not JSON that can be read"),
    ("a directory", lambda path: path.mkdir(), "cannot read it (Is a directory)"),
    ("a list", _bytes(b"[1, 2]"), "holds a JSON array; expected an object"),
    ("a string", _bytes(b'"profile"'), "holds a JSON string; expected an object"),
    ("null", _bytes(b"null"), "holds a JSON null; expected an object"),
]


@pytest.mark.parametrize("make, expected", [c[1:] for c in FILE_CASES],
                         ids=[c[0] for c in FILE_CASES])
@pytest.mark.parametrize("kind", ["budget", "poly"])
def test_a_file_that_is_no_profile_is_refused_in_one_line(tmp_path, make, expected, kind):
    path = tmp_path / "profile.json"
    make(path)
    loader, error, prefix = ((budget_profile.load, BudgetError, "--budget_profile") if kind == "budget"
                             else (load_profile_file, ProfileError, "TeaCache profile"))
    with pytest.raises(error) as refused:
        loader(str(path))
    message = one_line(refused.value)
    assert message.startswith(f"{prefix} {path}: {expected}"), message


def test_a_missing_budget_profile_is_refused_in_one_line(tmp_path):
    with pytest.raises(BudgetError) as refused:
        budget_profile.load(str(tmp_path / "none.json"))
    assert one_line(refused.value) == (f"--budget_profile {tmp_path / 'none.json'}: cannot read "
                                       "it (No such file or directory)")


# --- the commands: one line, exit 2, nothing written -----------------------------------------------

def snapshot(path):
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(Path(path).rglob("*"))
            if p.is_file()}


def stage2_argv(out):
    return ["--model", MODEL, "--num_inference_steps", str(STEPS), "--output_dir", str(out),
            "--compile_cache_dir", "none", "--no_progress"]


@pytest.mark.parametrize("kind", ["budget", "poly"])
def test_stage2_refuses_a_tampered_profile_in_one_line_and_writes_nothing(tmp_path, written, kind):
    """End to end, as a user runs it: the issue's tamperings (a negative error the budget would
    have chosen for any target; experts as a list) stop stage 2 before any model work."""
    if kind == "budget":
        path = tampered(tmp_path, written, _set(*C1, "rel_l2", 0, -0.5))
        flags = ["--budget_profile", path, "--budget_rel_err", "0.01"]
        line = (f"--budget_profile {path}: budget.candidates[1].rel_l2[0] -0.5: expected a "
                "relative L2 error >= 0")
    else:
        path = tampered(tmp_path, written, _set("experts", [1, 2]))
        flags = ["--teacache", "--teacache_policy", f"poly:{path}"]
        line = f"TeaCache profile {path}: experts [1, 2]: expected an object mapping"
    before = snapshot(tmp_path)
    out = subprocess.run([sys.executable, str(ROOT / "stage2_transformer_flax_deepcache.py"),
                          *stage2_argv(tmp_path / "out"), *flags], cwd=tmp_path,
                         capture_output=True, text=True)
    assert out.returncode == 2 and out.stdout == "", out
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith("stage2_transformer_flax_deepcache.py: error: "), out.stderr
    assert line in out.stderr, out.stderr
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("change, field", [
    (_set(*B, "steps", "6"), "budget.steps '6': expected an integer >= 1"),
    (_set(*C0, "computed", 0, -0.5), "budget.candidates[0].computed[0] -0.5: expected"),
    (_set(*B, "model", [MODEL]), f"budget.model [\"{MODEL}\"]: expected a non-empty string"),
], ids=["steps a string", "negative computed", "model a list"])
def test_stage2_refuses_the_issues_budget_tamperings(tmp_path, written, capsys, change, field):
    path = tampered(tmp_path, written, change)
    before = snapshot(tmp_path)
    capsys.readouterr()
    assert stage2.main([*stage2_argv(tmp_path / "out"), "--budget_profile", path,
                        "--budget_rel_err", "0.01"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert f"--budget_profile {path}: {field}" in err, err
    assert snapshot(tmp_path) == before


def test_calibrate_refuses_to_write_a_profile_its_loader_would_refuse(tmp_path, monkeypatch,
                                                                      capsys):
    """A fit that is not finite (non-finite weights) is one line and no file, not a profile that
    every later run refuses."""
    fit = calibration.fit

    def non_finite(pairs, degree):
        result = fit(pairs, degree)
        result["coefficients"][0] = math.nan
        return result
    monkeypatch.setattr(calibration, "fit", non_finite)
    path = tmp_path / "profile.json"
    capsys.readouterr()
    assert calibrate.main(["--model", "wan-tiny-ti2v", "--samples", "1", "--num_inference_steps",
                           "4", "--degree", "1", "--out", str(path)]) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1, err
    assert (f"--out {path}: the calibration gave a profile its loader would refuse "
            "(coefficients[0] nan: expected a finite number") in err, err
    assert not path.exists() and list(tmp_path.iterdir()) == []


# --- issue 40: an error of 0 where blocks were reused, tail blocks beyond the model ---------------

def _zero_error_where_it_reused(p):
    """Candidate 0 claims an error of 0 on every draw while computing half the blocks: its bound
    is 0, and budgeted mode chose it for any target."""
    c = p["budget"]["candidates"][0]
    c["rel_l2"], c["computed"] = [0.0] * len(c["rel_l2"]), [0.5] * len(c["computed"])


def _bn_beyond_the_model(p):
    """Candidate 0 with more tail blocks than the model has, and the best measurements, so that
    budgeted mode chooses it."""
    c = p["budget"]["candidates"][0]
    c["config"]["bn_blocks"] = 1000
    c["rel_l2"] = [1e-12 * (1 + k / 10) for k in range(len(c["rel_l2"]))]
    c["computed"] = [0.5] * len(c["computed"])


def test_an_error_of_0_on_a_draw_that_reused_blocks_is_refused(tmp_path, written):
    path = tampered(tmp_path, written, _zero_error_where_it_reused)
    label = written["budget"]["candidates"][0]["label"]
    with pytest.raises(BudgetError) as refused:
        budget_profile.load(path)
    assert one_line(refused.value) == (
        f"--budget_profile {path}: budget.candidates[0].rel_l2[0] 0.0: expected an error > 0 "
        f"({label!r} reused blocks on that draw, computing 0.5 of them, and a reuse never "
        "reproduces the uncached run exactly); calibrate again")


def test_an_error_of_0_on_a_draw_that_computed_everything_is_a_measurement(tmp_path, written):
    def nothing_reused(p):
        p["budget"]["candidates"][0]["rel_l2"][0] = 0.0
        p["budget"]["candidates"][0]["computed"][0] = 1.0
    assert budget_profile.load(tampered(tmp_path, written, nothing_reused))["candidates"][0]["rel_l2"][0] == 0


def test_tail_blocks_beyond_the_model_are_refused_naming_the_file(tmp_path, written):
    path = tampered(tmp_path, written, _bn_beyond_the_model)
    with pytest.raises(BudgetError) as refused:
        budget_profile.load(path)
    message = one_line(refused.value)
    assert message.startswith(f"--budget_profile {path}: budget.candidates[0].config.bn_blocks "
                              "1000: expected probe blocks ("), message
    assert "+ tail blocks (1000) <= " in message and "model's blocks (budget.model)" in message


@pytest.mark.parametrize("change, field", [
    (_zero_error_where_it_reused, "budget.candidates[0].rel_l2[0] 0.0: expected an error > 0"),
    (_bn_beyond_the_model, "budget.candidates[0].config.bn_blocks 1000: expected probe blocks"),
], ids=["error 0 where it reused", "bn beyond the model"])
def test_stage2_refuses_these_profiles_naming_the_file(tmp_path, written, capsys, change, field):
    """Was: the error-0 candidate chosen for any target and run; the bn one chosen, then refused as
    "the defaults: probe blocks (1) + tail blocks (1000) exceed ...", naming no file."""
    path = tampered(tmp_path, written, change)
    before = snapshot(tmp_path)
    capsys.readouterr()
    assert stage2.main([*stage2_argv(tmp_path / "out"), "--budget_profile", path,
                        "--budget_rel_err", "1e-9"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert f"--budget_profile {path}: {field}" in err, err
    assert snapshot(tmp_path) == before
