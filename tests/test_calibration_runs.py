"""A killed budget calibration resumes from its runs file (commands/calibration_runs.py)."""

import json

import pytest

from cache import CMConfig
from commands import calibrate
from sampling import calibration
from sampling.calibration_runs import RunMemo, RunsFileError
from tests.test_calibrate import SMALL_SPACE

IDENTITY = {"weights": "abc", "steps": 12}
FIELDS = {"fbcache": {"threshold": 0.2}}


def test_runs_come_back_from_the_file_and_a_torn_last_line_runs_again(tmp_path):
    path = tmp_path / "runs.jsonl"
    memo = RunMemo(str(path), IDENTITY)
    assert memo.get(FIELDS, 3) is None
    memo.add(FIELDS, 3, 0.25, 0.5)
    memo.add(FIELDS, 4, float("nan"), 0.75)  # a diverged run is a run too
    again = RunMemo(str(path), IDENTITY)
    assert again.get(FIELDS, 3) == (0.25, 0.5) and again.get({"fbcache": {"threshold": 0.3}}, 3) is None
    error, computed = again.get(FIELDS, 4)
    assert error != error and computed == 0.75
    assert again.reused == 2
    with open(path, "a") as f:  # a kill in the middle of a line
        f.write('{"key": "[{\\"fbc')
    inode, before = path.stat().st_ino, path.read_bytes()
    assert again.resumed() == f"resuming from {path}: 2 finished run(s) kept"
    torn = RunMemo(str(path), IDENTITY)
    assert len(torn) == 2 and path.read_text().endswith("0.75}\n")
    # cut in place (issue 62: rewriting the kept lines put all of them at risk of a kill)
    assert path.stat().st_ino == inode and before.startswith(path.read_bytes())
    assert torn.resumed().endswith("2 finished run(s) kept, a last line torn by a kill dropped "
                                   "(it runs again)")
    assert RunMemo(str(tmp_path / "new.jsonl"), IDENTITY).resumed() is None
    torn.add(FIELDS, 5, 0.1, 0.4)  # goes on after the cut, on its own line
    assert RunMemo(str(path), IDENTITY).get(FIELDS, 5) == (0.1, 0.4)


def test_runs_of_other_weights_or_settings_are_refused_not_mixed_in(tmp_path):
    path = tmp_path / "runs.jsonl"
    RunMemo(str(path), IDENTITY).add(FIELDS, 3, 0.25, 0.5)
    before = path.read_text()
    with pytest.raises(RunsFileError, match=r"differs in: \['steps'\]"):
        RunMemo(str(path), {**IDENTITY, "steps": 20})
    lines = before.split("\n")
    path.write_text("\n".join([lines[0], "not a run", lines[1], ""]))
    with pytest.raises(RunsFileError, match="line 2 is not a run"):
        RunMemo(str(path), IDENTITY)
    path.write_text("[1, 2]\n")
    with pytest.raises(RunsFileError, match="not a header"):
        RunMemo(str(path), IDENTITY)
    assert path.read_text() == "[1, 2]\n"  # refused files are left as they were


def _calibrate(tmp_path, runs, steps="12"):
    return calibrate.main(["--model", "wan-tiny-ti2v", "--samples", "2", "--first_seed", "1",
                           "--num_inference_steps", steps, "--budget", "--screen_draws", "2",
                           "--confirm_draws", "2", "--out", str(tmp_path / "profile.json"),
                           "--runs", str(runs)])


def test_a_killed_calibration_resumes_with_the_runs_it_finished(tmp_path, monkeypatch, capsys):
    from sampling import budget_space
    monkeypatch.setattr(budget_space, "space", lambda *_: SMALL_SPACE)
    runs = tmp_path / "runs.jsonl"
    assert _calibrate(tmp_path, runs) == 0
    whole = json.loads((tmp_path / "profile.json").read_text())["budget"]
    lines = runs.read_text().splitlines()
    measured = sum(len(c["rel_l2"]) + len(c.get("screen", {}).get("rel_l2", ()))
                   + len(c.get("confirm", {}).get("rel_l2", ())) for c in whole["candidates"])
    assert len(lines) == 1 + measured  # the header, and every configuration run once
    # killed after 4 runs: the rerun samples the rest, and only those
    runs.write_text("\n".join(lines[:5]) + "\n")
    (tmp_path / "profile.json").unlink()
    sampled = []
    runner = calibrate.runner

    def counting(*args, **kwargs):
        once = runner(*args, **kwargs)

        def counted(config, seed, tensors):
            if config != CMConfig():  # the uncached references are not runs
                sampled.append(seed)
            return once(config, seed, tensors)
        return counted

    monkeypatch.setattr(calibrate, "runner", counting)
    capsys.readouterr()
    assert _calibrate(tmp_path, runs) == 0
    assert len(sampled) == measured - 4
    assert f"resuming from {runs}: 4 finished run(s) kept" in capsys.readouterr().err
    resumed = json.loads((tmp_path / "profile.json").read_text())["budget"]
    assert resumed == whole
    # finished: a third run samples nothing
    sampled.clear()
    assert _calibrate(tmp_path, runs) == 0 and sampled == []


def test_runs_need_the_budget_and_a_file_of_the_same_settings(tmp_path, monkeypatch, capsys):
    from sampling import budget_space
    monkeypatch.setattr(budget_space, "space", lambda *_: SMALL_SPACE)
    assert calibrate.main(["--model", "wan-tiny-ti2v", "--out", str(tmp_path / "p.json"),
                           "--runs", str(tmp_path / "r.jsonl")]) == 2
    assert "--runs" in capsys.readouterr().err and not (tmp_path / "r.jsonl").exists()
    runs = tmp_path / "runs.jsonl"
    RunMemo(str(runs), {"weights": "other"})
    before = runs.read_text()
    assert _calibrate(tmp_path, runs) == 2
    err = capsys.readouterr().err
    assert "holds runs of other weights or settings" in err and "steps" in err
    assert runs.read_text() == before and not (tmp_path / "profile.json").exists()


def test_the_floor_is_the_uncached_run_on_bf16_weights_and_the_weights_come_back(tmp_path):
    # a chaotic draw is told by its floor (sampling/budget.py screen): measured here against a
    # copy of the model whose weights were rounded by hand, and kept in the runs file
    import copy

    import torch

    from sampling.fidelity import fidelity
    from sampling.pipelines import get_pipeline
    from torch_backend.backend import TorchBackend

    pipe = get_pipeline("wan-tiny-ti2v")
    shape = pipe.latent_shape(*pipe.size)
    models = calibrate.load_models(pipe, None, torch.float32)
    before = {n: p.clone() for n, p in models[None].named_parameters()}
    rounded = copy.deepcopy(models[None])
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    tensors = {1: pipe.synthesize(shape, True, False, 1)}
    memo = RunMemo(str(tmp_path / "runs.jsonl"), IDENTITY)

    def runner(which):
        return calibrate.runner(lambda plan: TorchBackend(which, plan), pipe, shape, steps=6,
                                solver=pipe.solver, shift=pipe.shift)

    score = calibration.scorer(runner(models), tensors, memo, list(models.values()))
    floor = score.floor(1)
    uncached = CMConfig()
    by_hand = fidelity(runner({None: rounded})(uncached, 1, tensors[1])[0],
                       runner(models)(uncached, 1, tensors[1])[0])["rel_l2"]
    assert 0.0 < floor == pytest.approx(by_hand, rel=1e-6)
    assert all(torch.equal(p, before[n]) for n, p in models[None].named_parameters())
    assert RunMemo(str(tmp_path / "runs.jsonl"), IDENTITY).get(calibration.FLOOR, 1) == (floor, 1.0)
    assert calibration.scorer(runner(models), tensors).floor is None  # no models: no chaos check
