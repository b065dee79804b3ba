"""What a user sees of every command: --help grouped on one screen, --help_all complete,
progress bars on stderr only when it is a terminal (never with --quiet), --summary_json."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from commands import calibrate, generate, stage1, stage2, stage3
from sampling.cli import SECTIONS

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {"stage1_encode.py": stage1, "stage2_transformer_flax_deepcache.py": stage2,
            "stage3_vae_decode.py": stage3, "generate.py": generate, "calibrate.py": calibrate}
SCREEN = 60  # lines


def run(script, *args, cwd=ROOT, env=None):
    return subprocess.run([sys.executable, str(ROOT / script), *args], cwd=cwd,
                          capture_output=True, text=True, env=env)


def _help(module, flag, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as exit_:
        module.main([flag])
    assert exit_.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("script", sorted(COMMANDS))
def test_help_is_grouped_one_line_a_flag_on_one_screen(script, capsys, monkeypatch):
    lines = _help(COMMANDS[script], "--help", capsys, monkeypatch).splitlines()
    assert len(lines) <= SCREEN, (script, len(lines))
    headers = [line[:-1] for line in lines if line.endswith(":") and not line.startswith(" ")]
    assert headers and set(headers) <= set(SECTIONS), headers
    assert headers == [s for s in SECTIONS if s in headers], "sections out of order"
    assert "inputs and model" in headers and "outputs and reports" in headers
    body = lines[lines.index(headers[0] + ":"):]
    for line in body:  # a flag line, a section header, a blank, or the pointer to --help_all
        assert (line.startswith("  -") or line[:-1] in SECTIONS or not line.strip()
                or "--help_all" in line), line
        assert len(line) <= 100, line
    # every flag of the parser is either on this screen or counted in the pointer
    parser = COMMANDS[script].build_parser()
    flags = [a for a in parser._actions if a.option_strings]
    shown = [line for line in body if line.startswith("  -")]
    more = int(lines[-1].split()[0]) if "--help_all" in lines[-1] else 0
    assert len(shown) + more == len(flags)


@pytest.mark.parametrize("script", sorted(COMMANDS))
def test_help_all_names_every_flag(script, capsys, monkeypatch):
    out = _help(COMMANDS[script], "--help_all", capsys, monkeypatch)
    parser = COMMANDS[script].build_parser()
    for action in parser._actions:
        for flag in action.option_strings:
            assert flag in out, (script, flag)


def test_the_scripts_print_the_same_help():
    out = run("stage3_vae_decode.py", "--help")
    assert out.returncode == 0 and "inputs and model:" in out.stdout and "--help_all" in out.stdout


def _run_on_a_terminal(args, cwd):
    """The stage-2 command with stderr on a pseudo-terminal; (stdout, what the terminal got)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 100 columns
    proc = subprocess.Popen([sys.executable, str(ROOT / "stage2_transformer_flax_deepcache.py"),
                             *args], cwd=cwd, stdout=subprocess.PIPE, stderr=follower, text=True)
    os.close(follower)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    stdout = proc.stdout.read()
    assert proc.wait() == 0, seen.decode(errors="replace")
    os.close(leader)
    return stdout, seen.decode(errors="replace")


TINY = ["--model", "hunyuanvideo-tiny", "--backend", "torch", "--num_inference_steps", "6",
        "--enable_cache"]


def test_progress_on_a_terminal_only_never_with_quiet_and_the_summary_json(tmp_path):
    stdout, terminal = _run_on_a_terminal([*TINY, "--output_dir", "a"], tmp_path)
    assert "denoise" in terminal and "6/6" in terminal and "reused" in terminal
    assert "warm-up" in terminal
    assert "denoise" not in stdout and "computed" in stdout  # the summary stays on stdout
    _, quiet = _run_on_a_terminal([*TINY, "--output_dir", "b", "--quiet"], tmp_path)
    assert "denoise" not in quiet and "warm-up" not in quiet
    piped = run("stage2_transformer_flax_deepcache.py", *TINY, "--output_dir", "c",
                "--summary_json", "s.json", cwd=tmp_path)
    assert piped.returncode == 0 and "denoise" not in piped.stderr and "\r" not in piped.stderr
    report = json.loads((tmp_path / "s.json").read_text())
    assert report["model"] == "hunyuanvideo-tiny" and report["steps"] == 6


def test_a_summary_json_in_a_missing_folder_is_refused_before_any_work(tmp_path, capsys):
    code = stage2.main([*TINY, "--output_dir", str(tmp_path / "x"),
                        "--summary_json", str(tmp_path / "no" / "s.json")])
    assert code == 2 and "--summary_json" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("argv, hint", [
    (["--steps", "0"], "(--steps: did you mean --num_inference_steps?)"),
    (["--num_frames", "9"], "(--num_frames: did you mean --video_length?)"),
    (["--guidance_scal=4"], None),  # argparse's own prefix match takes it: no error
    (["--enable_cahce"], "(--enable_cahce: did you mean --enable_cache?)"),
    (["--zzz", "1"], ""),
])
def test_an_unknown_flag_is_named_with_the_nearest_one(capsys, argv, hint):
    """Issue 62: `--steps 0` got "unrecognized arguments" with no hint."""
    parser = generate.build_parser()
    if hint is None:
        parser.parse_args(["--prompt", "x", *argv])
        return
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--prompt", "x", *argv])
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"unrecognized arguments: {' '.join(argv)}" in err
    assert (hint in err) if hint else "did you mean" not in err


def test_help_takes_the_whole_width_of_the_terminal(capsys, monkeypatch):
    """Issue 62: --help cut its lines at 120 columns with COLUMNS=250; generate.py's
    --output_dir said ./stage_outputs where it writes ./outputs."""
    monkeypatch.setenv("COLUMNS", "250")
    with pytest.raises(SystemExit):
        generate.main(["--help"])
    lines = capsys.readouterr().out.splitlines()
    assert 120 < max(map(len, lines)) <= 250
    assert any("--output_dir" in line and "(default ./outputs)" in line for line in lines)


def test_an_unknown_model_or_word_is_named_with_the_nearest_known_one():
    from encoders.word_table import WordTable
    from sampling.pipelines import get_pipeline
    with pytest.raises(ValueError, match="unknown model 'wan-tiny-traned'; did you mean "
                                         "'wan-tiny-trained'\\? expected one of"):
        get_pipeline("wan-tiny-traned")
    with pytest.raises(ValueError, match="unknown model 'zzz'; expected one of"):
        get_pipeline("zzz")
    table = WordTable([[0.0]] * 3, [[0.0]] * 4, ["red", "circle", "moves"])
    problem, expected = table.problem("red circel mooves zebra")
    assert problem == ("unknown words circel, mooves, zebra ('circel': did you mean 'circle'?; "
                       "'mooves': did you mean 'moves'?)") and expected.endswith("red circle moves")
