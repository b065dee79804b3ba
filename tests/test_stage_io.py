"""Stage files: round trips, the TPU port's conventions, checks, atomic writes."""

import json
import os

import pytest
import torch

from sampling import journal, stage_io
from sampling.errors import StageFileError
from sampling.pipelines import get_pipeline
from sampling.stage_io import (
    CONFIG,
    EMBEDDINGS,
    LATENTS,
    PAIR_ID,
    read_stage1,
    read_stage2,
    write_stage,
    write_stage2,
)


def stage1_dir(tmp_path, name="hunyuanvideo-tiny", mutate=None, config=None):
    pipe = get_pipeline(name)
    shape = pipe.latent_shape(*pipe.size)
    tensors = pipe.synthesize(shape, True, pipe.task == "i2v", seed=3)
    if mutate:
        mutate(tensors)
    write_stage(str(tmp_path), tensors, EMBEDDINGS, {"prompt": "a cat"},
                config if config is not None else {"prompt": "a cat", "task_type": "t2v"})
    return pipe, shape, tensors


def test_stage2_round_trip_keeps_values_dtype_and_metadata(tmp_path):
    latents = torch.randn(1, 4, 3, 4, 5).to(torch.bfloat16)
    paths = write_stage2(str(tmp_path), latents, {"seed": 42, "deepcache_enabled": True},
                         {"prompt": "p", "seed": 42})
    assert set(paths) == {LATENTS, CONFIG}
    got, meta, config = read_stage2(str(tmp_path))
    assert got.dtype == torch.bfloat16 and torch.equal(got, latents)
    assert meta["seed"] == "42" and meta["deepcache_enabled"] == "true"
    assert json.loads(meta["dtype_info"]) == {"latents": "torch.bfloat16"}
    assert config.pop(PAIR_ID) == meta[PAIR_ID]  # the two files are one pair
    assert config == {"prompt": "p", "seed": 42}
    assert sorted(os.listdir(tmp_path)) == [CONFIG, LATENTS]  # no temporary left over


def test_stage1_is_read_and_checked_against_the_pipeline(tmp_path):
    pipe, shape, tensors = stage1_dir(tmp_path)
    got, config = read_stage1(str(tmp_path), pipe.stage1_specs(shape, True, False))
    assert config["task_type"] == "t2v"
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)


def test_bf16_saved_as_fp32_with_dtype_info_comes_back_as_bf16(tmp_path):
    """The Wan utils of the TPU port store bf16 embeddings as fp32 plus `dtype_info`."""
    from safetensors.torch import save_file
    path = tmp_path / EMBEDDINGS
    save_file({"prompt_embeds": torch.ones(1, 3, 16)}, str(path),
              metadata={"dtype_info": json.dumps({"prompt_embeds": "torch.bfloat16"})})
    tensors, _ = stage_io.read_tensors(str(path))
    assert tensors["prompt_embeds"].dtype == torch.bfloat16


@pytest.mark.parametrize("mutate, message", [
    (lambda t: t.pop("negative_prompt_embeds_mask"), "lacks negative_prompt_embeds_mask"),
    (lambda t: t.update(prompt_embeds=t["prompt_embeds"][:, :5]), "prompt_embeds has shape"),
    (lambda t: t.update(prompt_embeds_2=t["prompt_embeds_2"].double()), "dtype torch.float64"),
    (lambda t: t["prompt_embeds"].__setitem__((0, 0, 0), float("nan")), "NaN"),
])
def test_malformed_stage1_names_the_problem(tmp_path, mutate, message):
    pipe, shape, _ = stage1_dir(tmp_path, mutate=mutate)
    with pytest.raises(StageFileError, match=message):
        read_stage1(str(tmp_path), pipe.stage1_specs(shape, True, False))


def test_missing_files_and_bad_json(tmp_path):
    with pytest.raises(StageFileError, match="not a directory"):
        read_stage1(str(tmp_path / "nope"), {})
    with pytest.raises(StageFileError, match=f"{CONFIG} is missing"):
        read_stage1(str(tmp_path), {})
    (tmp_path / CONFIG).write_text("{not json")
    with pytest.raises(StageFileError, match="not valid JSON"):
        read_stage1(str(tmp_path), {})
    (tmp_path / CONFIG).write_text("[1, 2]")
    with pytest.raises(StageFileError, match="expected a JSON object"):
        read_stage1(str(tmp_path), {})
    (tmp_path / CONFIG).write_text("{}")
    with pytest.raises(StageFileError, match=f"{EMBEDDINGS} is missing"):
        read_stage1(str(tmp_path), {})
    (tmp_path / EMBEDDINGS).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{truncated")
    with pytest.raises(StageFileError, match="not a readable safetensors"):
        read_stage1(str(tmp_path), {})


def test_a_failed_write_leaves_no_partial_output(tmp_path, monkeypatch):
    real = stage_io.write_tensors

    def disk_full(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"half")
        raise OSError(28, "No space left on device")

    out = tmp_path / "out"
    monkeypatch.setattr(stage_io, "write_tensors", disk_full)
    with pytest.raises(StageFileError, match="disk is full"):
        write_stage2(str(out), torch.zeros(1, 4, 1, 2, 2), {}, {"a": 1})
    assert list(out.iterdir()) == []
    # a rerun that fails keeps the previous run's files, untouched
    monkeypatch.setattr(stage_io, "write_tensors", real)
    write_stage2(str(out), torch.ones(1), {}, {"run": 1})
    monkeypatch.setattr(stage_io, "write_tensors", disk_full)
    with pytest.raises(StageFileError, match="earlier runs are as they were"):
        write_stage2(str(out), torch.zeros(1), {}, {"run": 2})
    latents, _, config = read_stage2(str(out))
    assert latents.item() == 1.0 and config["run"] == 1
    assert sorted(p.name for p in out.iterdir()) == [CONFIG, LATENTS]


def test_a_rename_that_fails_after_the_commit_is_finished_by_the_next_read(tmp_path, monkeypatch):
    """Once the journal is in, the new pair is decided: a failed rename is completed later."""
    real = os.replace

    def fail_on_config(src, dst):
        if str(dst).endswith(CONFIG):
            raise OSError("I/O error")
        return real(src, dst)

    out = tmp_path / "out"
    write_stage2(str(out), torch.ones(1), {}, {"run": 1})
    monkeypatch.setattr(stage_io.os, "replace", fail_on_config)
    with pytest.raises(StageFileError, match="next run or read of the folder finishes it"):
        write_stage2(str(out), torch.zeros(1), {}, {"run": 2})
    monkeypatch.setattr(stage_io.os, "replace", real)
    latents, _, config = read_stage2(str(out))
    assert latents.item() == 0.0 and config["run"] == 2
    assert sorted(p.name for p in out.iterdir()) == [CONFIG, LATENTS]


def test_output_path_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(StageFileError, match="not a directory"):
        write_stage2(str(tmp_path / "f"), torch.zeros(1), {}, {})


def test_what_an_older_version_left_after_a_kill_is_restored(tmp_path):
    """Before the journal, the old latents were renamed to a `.previous.*.tmp` backup first; a
    kill then left no latents. The next writer or reader puts the backup back."""
    write_stage2(str(tmp_path), torch.ones(1), {}, {"run": 1})
    os.replace(tmp_path / LATENTS, tmp_path / ".previous.abc123.tmp")
    (tmp_path / ".stage2_latents.safetensors.xyz.tmp").write_bytes(b"half")
    latents, _, config = read_stage2(str(tmp_path))
    assert latents.item() == 1.0 and config["run"] == 1
    assert sorted(os.listdir(tmp_path)) == [CONFIG, LATENTS]


def test_a_live_writers_temporary_file_is_not_taken_for_a_stale_one(tmp_path):
    held = journal.temporary(str(tmp_path), LATENTS)  # flock'ed by this process
    try:
        journal.remove_stale(str(tmp_path), (LATENTS,))
        assert os.path.exists(held)
        other = os.open(held, os.O_RDONLY)  # as another process sees it: locked
        try:
            import fcntl
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(other)
    finally:
        journal.release(held)
    assert os.listdir(tmp_path) == []


def test_the_journal_commits_any_files_of_a_folder_as_one(tmp_path):
    """sampling.journal knows no stage file: two files of any names are renamed in together, or
    (closed before the commit) neither is, and no temporary file outlives the close."""
    (tmp_path / "a.txt").write_text("old a")
    (tmp_path / "b.bin").write_bytes(b"old b")
    for commit, a, b in ((False, "old a", b"old b"), (True, "new a", b"new b")):
        with journal.folder_lock(str(tmp_path), exclusive=True):
            files = journal.Commit(str(tmp_path), journal.Staged())
            try:
                with open(files.temporary("a.txt"), "w") as f:
                    f.write("new a")
                with open(files.temporary("b.bin"), "wb") as f:
                    f.write(b"new b")
                if commit:
                    files.commit()
            finally:
                files.close()
        assert files.journaled == commit
        assert (tmp_path / "a.txt").read_text() == a and (tmp_path / "b.bin").read_bytes() == b
        assert sorted(os.listdir(tmp_path)) == ["a.txt", "b.bin"]


def test_a_journal_left_by_a_kill_is_rolled_forward(tmp_path):
    """Killed after the journal was renamed in: the next roll_forward finishes the renames."""
    (tmp_path / "a.txt").write_text("old")
    tmp = journal.temporary(str(tmp_path), "a.txt")
    with open(tmp, "w") as f:
        f.write("new")
    journal.forget(tmp)  # as a killed writer leaves it: unlocked, named by the journal
    (tmp_path / journal.JOURNAL).write_text(json.dumps({"renames": [[os.path.basename(tmp),
                                                                      "a.txt"]]}))
    journal.roll_forward(str(tmp_path))
    assert (tmp_path / "a.txt").read_text() == "new" and os.listdir(tmp_path) == ["a.txt"]


def test_stage_io_exports_only_its_own_names():
    """The journal's and the video file's names are imported from their own modules (one
    import path for one name, tests/test_layering.py)."""
    from sampling import video_file
    assert all(hasattr(stage_io, name) for name in stage_io.__all__)
    assert not {"Staged", "atomic_write", "StageFileError", "encode_mp4"} & set(stage_io.__all__)
    assert journal.Staged and video_file.encode_mp4
