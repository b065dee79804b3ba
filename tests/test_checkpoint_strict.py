"""Checkpoint files checked as strictly as the safetensors format, non-finite weights refused at
load, and each refusal one line naming the file and tensor (issue 23, items 1, 7 and 10).

Every tampered header the safetensors library refuses used to pass the project's own header
check and crash mid-load (or, for an integer dtype the library accepts, in load_state_dict); a
NaN or Inf weight loaded silently and gave all-NaN latents with exit 0."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

import stage2_transformer_flax_deepcache as stage2
import stage3_vae_decode as stage3
from commands import calibrate
from modules import checkpoint, safetensors_reader
from modules.checkpoint import INDEX_NAME, WEIGHTS_NAME, load_model, save_checkpoint
from modules.layouts import CheckpointError
from modules.safetensors_reader import read_header
from modules.vae import VAES, VaeError, build_tiny, load_vae
from tests.model_inputs import random_model
from tests.test_refusals import refused
from tests.test_stage3 import stage2_dir

ROOT = Path(__file__).resolve().parents[1]
MODEL = "wan-tiny-ti2v"  # the model the stage-2 command runs by default in these tests


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return save_checkpoint(random_model(MODEL), tmp_path_factory.mktemp("ckpt") / "wan")


@pytest.fixture
def saved(tmp_path, pristine):
    return Path(shutil.copytree(pristine, tmp_path / "wan"))


def split(file: Path) -> tuple[dict, bytes]:
    raw = file.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + length]), raw[8 + length:]


def write(file: Path, header, data: bytes) -> None:
    """A safetensors file from a header (dict, or raw bytes as they are) and its data section."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def by_offset(header: dict) -> list[str]:
    """Tensor names in data order, 2-D or more only (so a shape has dims to tamper with)."""
    names = [k for k in header if k != "__metadata__" and len(header[k]["shape"]) >= 2]
    return sorted(names, key=lambda k: header[k]["data_offsets"])


# --- the table: tampered file -> the refusal ---------------------------------------------------

def _trailing(h, d):
    return h, d + b"\0" * 16


def _overlap(h, d):
    first, second = by_offset(h)[:2]
    size = h[second]["data_offsets"][1] - h[second]["data_offsets"][0]
    begin = h[first]["data_offsets"][0]
    h[second]["data_offsets"] = [begin, begin + size]
    return h, d


def _negative_offset(h, d):
    name = by_offset(h)[0]
    begin, end = h[name]["data_offsets"]
    h[name]["data_offsets"] = [-4, end - begin - 4]
    return h, d


def _gap(h, d):
    del h[by_offset(h)[1]]  # its bytes stay: a hole between its neighbours
    return h, d


def _reversed_offsets(h, d):
    name = by_offset(h)[0]
    h[name]["data_offsets"] = h[name]["data_offsets"][::-1]
    return h, d


def _truncated(h, d):
    return h, d[:-100]


def _metadata_value(h, d):
    h["__metadata__"] = {"format": 1}
    return h, d


def _metadata_list(h, d):
    h["__metadata__"] = ["format"]
    return h, d


def _negative_dims(h, d):
    name = by_offset(h)[0]
    h[name]["shape"] = [-n for n in h[name]["shape"]]
    return h, d


def _float_dims(h, d):
    name = by_offset(h)[0]
    h[name]["shape"] = [float(n) for n in h[name]["shape"]]
    return h, d


def _size_mismatch(h, d):
    name = by_offset(h)[0]
    h[name]["shape"] = [h[name]["shape"][0], h[name]["shape"][1] // 2]
    return h, d


def _int_dtype(h, d):  # same item size: the library itself takes it
    h[by_offset(h)[0]]["dtype"] = "I32"
    return h, d


def _unknown_dtype(h, d):
    h[by_offset(h)[0]]["dtype"] = "F32X"
    return h, d


def _entry_not_object(h, d):
    h["extra"] = 5
    return h, d


def _no_offsets(h, d):
    del h[by_offset(h)[0]]["data_offsets"]
    return h, d


def _not_utf8(h, d):
    return json.dumps(h).replace('"format"', '"f\udcffrmat"').encode("utf-8", "surrogateescape"), d


def _duplicate_key(h, d):
    name = by_offset(h)[0]
    text = json.dumps(h)
    entry = json.dumps(h[name])
    return text.replace("{", "{" + json.dumps(name) + ": " + entry + ", ", 1).encode(), d


def _not_an_object(h, d):
    return b"[1, 2]", d


def _nested_deep(h, d):
    return b"[" * 100_000, d


def _header_past_the_end(h, d):
    return None, None  # written by the test itself: the length field says 2^63


CASES = [  # (case, tamper, the message, whether the safetensors library refuses it too)
    ("trailing bytes", _trailing, r"16 trailing bytes after the last tensor .* expected the "
     r"tensors to cover the file exactly", True),
    ("overlapping offsets", _overlap, r"tensor '[^']+' data bytes \[\d+, \d+\) overlap tensor "
     r"'[^']+', which ends at \d+; expected contiguous tensors", True),
    ("negative offset", _negative_offset, r"tensor '[^']+': data_offsets \[-4, \d+\]; expected "
     r"\[begin, end\], integers >= 0", True),
    ("gap between tensors", _gap, r"tensor '[^']+' starts at data byte \d+, \d+ bytes after the "
     r"previous tensor ends; expected contiguous tensors", True),
    ("end before begin", _reversed_offsets, r"data_offsets \[\d+, \d+\] end before they begin",
     True),
    ("offsets past the end", _truncated, r"truncated: tensor '[^']+' ends at data byte \d+, the "
     r"file holds \d+ data bytes", True),
    ("__metadata__ value not a string", _metadata_value, r"__metadata__ 'format' is 1; expected "
     r"a map of strings to strings", True),
    ("__metadata__ not a map", _metadata_list, r"__metadata__ is \['format'\]; expected a map of "
     r"strings to strings", True),
    ("negative dims", _negative_dims, r"tensor '[^']+': shape \[-\d+(, -\d+)+\]; expected a list of "
     r"integers >= 0", True),
    ("fractional dims", _float_dims, r"shape \[\d+\.0(, \d+\.0)+\]; expected a list of integers >= 0",
     True),
    ("data size != numel * itemsize", _size_mismatch, r"tensor '[^']+' \[\d+(, \d+)+\] F32 should "
     r"take \d+ bytes, the header gives \d+", True),
    ("integer dtype", _int_dtype, r"tensor '[^']+' is I32; expected a float weight \(the model "
     r"holds it as torch.float32\)", False),
    ("unknown dtype", _unknown_dtype, r"dtype 'F32X'; expected one of \['BF16', ", True),
    ("entry not an object", _entry_not_object, r"tensor 'extra': header entry 5; expected an "
     r"object with dtype, shape and data_offsets", True),
    ("no data_offsets", _no_offsets, r"data_offsets None; expected \[begin, end\]", True),
    ("header not UTF-8", _not_utf8, r"corrupt safetensors header \(not valid UTF-8", True),
    ("duplicate key", _duplicate_key, r"corrupt safetensors header \(key '[^']+' appears twice\)",
     False),  # the library keeps one of the two silently
    ("header not an object", _not_an_object, r"corrupt safetensors header \(not a JSON object\)",
     True),
    ("header nested 100k deep", _nested_deep, r"corrupt safetensors header \(JSON nested too "
     r"deep\)", True),
    ("header length past the end", _header_past_the_end, r"not a safetensors file or truncated "
     r"\(header says 9223372036854775808 header bytes", True),
]


@pytest.mark.parametrize("case, tamper, message, library_refuses", CASES, ids=[c[0] for c in CASES])
def test_a_tampered_header_is_refused_naming_the_file_and_what_was_expected(
        saved, case, tamper, message, library_refuses):
    weights = saved / WEIGHTS_NAME
    header, data = split(weights)
    new_header, new_data = tamper(header, data)
    if new_header is None:
        weights.write_bytes(struct.pack("<Q", 2 ** 63) + weights.read_bytes()[8:])
    else:
        write(weights, new_header, new_data)
    if library_refuses:  # nothing the format forbids gets past our check to fail mid-load
        with pytest.raises(SafetensorError):
            safe_open(str(weights), "pt").keys()
    with pytest.raises(CheckpointError, match=message) as err:
        load_model(saved, MODEL)
    text = str(err.value)
    assert text.startswith(f"{weights}: ") and "\n" not in text


def test_a_header_over_the_format_limit_is_refused_before_it_is_read(saved, monkeypatch):
    monkeypatch.setattr(safetensors_reader, "MAX_HEADER_BYTES", 1000)  # 100 MB in the format
    with pytest.raises(CheckpointError, match=r"header length \d+ bytes; the format allows at "
                                              r"most 1000"):
        read_header(saved / WEIGHTS_NAME)


def test_a_folder_named_safetensors_is_refused(saved):
    (saved / WEIGHTS_NAME).unlink()
    (saved / WEIGHTS_NAME).mkdir()
    with pytest.raises(CheckpointError, match=r"diffusion_pytorch_model.safetensors: not a "
                                              r"regular file; expected a safetensors file"):
        load_model(saved, MODEL)


@pytest.mark.parametrize("weight_map", [{"a": 5}, ["x.safetensors"], {"a": {"b": "c"}}])
def test_an_index_with_a_malformed_weight_map_is_refused(tmp_path, weight_map):
    index = tmp_path / INDEX_NAME
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="not a safetensors index"):
        load_model(index, MODEL)
    index.write_bytes(b'{"weight_map": {"a": "\xff"}}')
    with pytest.raises(CheckpointError, match="not a safetensors index"):
        load_model(index, MODEL)


def test_a_clean_checkpoint_still_loads_with_metadata_and_padding(tmp_path):
    """The strict check takes what the format allows: empty tensors, space padding, metadata."""
    state = {"w": torch.randn(3, 4), "empty": torch.zeros(0, 4), "b": torch.randn(5)}
    save_file(state, tmp_path / "x.safetensors", metadata={"format": "pt", "note": ""})
    header, data = split(tmp_path / "x.safetensors")
    write(tmp_path / "x.safetensors", json.dumps(header).encode() + b"       ", data)
    info = read_header(tmp_path / "x.safetensors")
    assert {k: v.shape for k, v in info.items()} == {"w": (3, 4), "empty": (0, 4), "b": (5,)}
    assert set(load_file(tmp_path / "x.safetensors")) == set(state)


# --- non-finite weights ------------------------------------------------------------------------

def _poison(saved, value):
    sd = load_file(saved / WEIGHTS_NAME)
    sd["blocks.1.ffn.0.weight"].view(-1)[7] = value
    save_file(sd, saved / WEIGHTS_NAME)
    return saved / WEIGHTS_NAME


@pytest.mark.parametrize("value, counts", [(math.nan, "1 NaN and 0 Inf"), (-math.inf, "0 NaN and 1 Inf")])
def test_a_non_finite_weight_is_refused_at_load_naming_file_and_key(saved, value, counts):
    weights = _poison(saved, value)
    numel = load_file(weights)["blocks.1.ffn.0.weight"].numel()
    with pytest.raises(CheckpointError) as err:
        load_model(saved, MODEL)
    assert str(err.value) == (f"{weights}: tensor 'blocks.1.ffn.0.weight' holds {counts} of "
                              f"{numel} values; a non-finite weight makes every output NaN")


def test_a_weight_that_overflows_the_load_dtype_is_refused(saved):
    _poison(saved, 1e6)  # finite in F32, inf in float16
    load_model(saved, MODEL)  # the checkpoint's own dtype: fine
    with pytest.raises(CheckpointError, match=r"tensor 'blocks.1.ffn.0.weight' has values up to "
                                              r"1e\+06, beyond torch.float16's range"):
        load_model(saved, MODEL, dtype=torch.float16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64,
                                   torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_all_finite_finds_one_bad_element_anywhere(dtype, bad):
    if dtype == torch.float8_e4m3fn and math.isinf(bad):
        pytest.skip("float8_e4m3fn has no Inf (it saturates to 448)")
    n = 3 * (checkpoint._FLOAT8_STEP + 1)  # float8 goes in steps: the last one is short
    t = torch.zeros(n, dtype=dtype)
    assert checkpoint.all_finite(t)
    for pos in (0, n // 2, n - 1):
        t = torch.zeros(n, dtype=dtype)
        t[pos] = bad
        assert not checkpoint.all_finite(t)
        assert not checkpoint.all_finite(t.view(3, -1)[:, 1:].t() if pos else t)  # strided too
    assert checkpoint.all_finite(torch.arange(5)) and checkpoint.all_finite(torch.zeros(0))


# --- the commands: one line, exit 2, nothing written ---------------------------------------------


def test_stage2_command_refuses_a_tampered_checkpoint_in_one_line(saved, tmp_path):
    weights = saved / WEIGHTS_NAME
    header, data = split(weights)
    write(weights, *_trailing(header, data))
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "stage2_transformer_flax_deepcache.py", "--model", MODEL,
                          "--model_path", str(saved), "--num_inference_steps", "2",
                          "--output_dir", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 2, run.stderr
    assert run.stdout == "" and run.stderr.count("\n") == 1, run.stderr
    assert run.stderr.startswith(f"stage2_transformer_flax_deepcache.py: error: {weights}: "
                                 "16 trailing bytes after the last tensor")
    assert not out.exists()


def test_stage2_command_refuses_a_nan_weight_and_writes_nothing(saved, tmp_path, capsys):
    weights = _poison(saved, math.nan)
    out = tmp_path / "out"
    refused(stage2.main, ["--model", MODEL, "--model_path", str(saved),
                                    "--num_inference_steps", "2", "--output_dir", str(out)],
                      capsys, f"{weights}: tensor 'blocks.1.ffn.0.weight' holds 1 NaN")
    assert not out.exists()


def test_calibrate_refuses_a_nan_weight_before_sampling(saved, tmp_path, capsys):
    """It used to sample NaN and stop in a traceback ("expected non-empty vector", item 8)."""
    weights = _poison(saved, math.nan)
    refused(calibrate.main, ["--model", MODEL, "--model_path", str(saved),
                                       "--out", str(tmp_path / "p.json")],
                      capsys, f"{weights}: tensor 'blocks.1.ffn.0.weight' holds 1 NaN")
    assert not (tmp_path / "p.json").exists()


def test_stage2_command_prints_a_checkpoint_that_does_not_fit_in_one_line(saved, tmp_path, capsys):
    sd = load_file(saved / WEIGHTS_NAME)
    for i in range(7):
        sd[f"blocks.0.extra{i}.weight"] = torch.zeros(3)
    del sd["blocks.1.norm3.bias"]
    sd["blocks.0.self_attn.q.weight"] = torch.zeros(24, 12)
    save_file(sd, saved / WEIGHTS_NAME)
    refused(stage2.main, ["--model", MODEL, "--model_path", str(saved),
                                    "--output_dir", str(tmp_path / "out")], capsys,
                      f"{saved} does not fit the model: missing (1): blocks.1.norm3.bias; "
                      "unexpected (7): blocks.0.extra0.weight, blocks.0.extra1.weight, "
                      "blocks.0.extra2.weight, blocks.0.extra3.weight, blocks.0.extra4.weight "
                      "(+2 more); mis-shaped (1): blocks.0.self_attn.q.weight: checkpoint "
                      "[24, 12], model [24, 24]")
    assert not (tmp_path / "out").exists()


# --- the stage-3 VAE loader: the same checks ----------------------------------------------------

def _tiny_spec():
    # single files carry no config: load_vae uses the spec's (a tiny one, as a test stand-in)
    base = VAES["wan2.2-vae"]
    return dataclasses.replace(base, config=base.tiny_config(48))


def _tiny_vae_file(tmp_path, suffix=".safetensors"):
    spec = _tiny_spec()
    state = {k: v.contiguous() for k, v in build_tiny(spec, 48, seed=5).state_dict().items()}
    path = tmp_path / f"vae{suffix}"
    if suffix == ".safetensors":
        save_file(state, path)
    else:
        torch.save(state, path)
    return spec, path, state


@pytest.mark.parametrize("case, tamper, message, library_refuses",
                         [c for c in CASES if c[0] in ("trailing bytes", "overlapping offsets",
                                                       "__metadata__ value not a string",
                                                       "negative dims")],
                         ids=["trailing bytes", "overlapping offsets", "__metadata__ value",
                              "negative dims"])
def test_the_vae_loader_checks_headers_alike(tmp_path, case, tamper, message, library_refuses):
    spec, path, _ = _tiny_vae_file(tmp_path)
    header, data = split(path)
    write(path, *tamper(header, data))
    with pytest.raises(VaeError, match=message) as err:
        load_vae(spec, str(path))
    assert str(err.value).startswith(f"--vae_path {path}: ")


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_the_vae_loader_refuses_non_finite_and_integer_weights(tmp_path, suffix):
    spec, path, state = _tiny_vae_file(tmp_path, suffix)
    key = "decoder.conv_in.weight"
    state[key].view(-1)[3] = math.nan
    save_file(state, path) if suffix == ".safetensors" else torch.save(state, path)
    with pytest.raises(VaeError, match=rf"--vae_path {path}: tensor '{key}' holds 1 NaN and 0 Inf"):
        load_vae(spec, str(path))
    state[key] = torch.zeros(state[key].shape, dtype=torch.int32)
    save_file(state, path) if suffix == ".safetensors" else torch.save(state, path)
    with pytest.raises(VaeError, match=rf"tensor '{key}' is (I32|torch.int32); expected a float"):
        load_vae(spec, str(path))


def test_a_diffusers_vae_folder_is_checked_alike(tmp_path):
    spec = VAES["hunyuanvideo-1.5-vae"]
    tiny = build_tiny(spec, 4, seed=5)
    with torch.no_grad():
        tiny.decoder.conv_in.conv.weight.view(-1)[0] = math.inf
    tiny.save_pretrained(str(tmp_path / "vae"))
    with pytest.raises(VaeError, match=rf"--vae_path {tmp_path / 'vae'}: tensor "
                                       r"'decoder.conv_in.conv.weight' holds 0 NaN and 1 Inf"):
        load_vae(spec, str(tmp_path / "vae"))
    weights = tmp_path / "vae" / WEIGHTS_NAME
    header, data = split(weights)
    write(weights, *_trailing(header, data))
    with pytest.raises(VaeError, match=rf"--vae_path {weights}: 16 trailing bytes"):
        load_vae(spec, str(tmp_path / "vae"))


def test_the_vae_loader_prints_a_misshaped_checkpoint_in_one_line(tmp_path):
    spec, path, state = _tiny_vae_file(tmp_path)
    state["decoder.conv_in.bias"] = torch.zeros(3)
    save_file(state, path)
    with pytest.raises(VaeError) as err:
        load_vae(spec, str(path))
    assert "mis-shaped 1 ['decoder.conv_in.bias: checkpoint [3], model [" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("content, message", [  # message: what follows the path
    (b"\x80\x02garbage that is no pickle at all" * 4, " is not a readable checkpoint (UnpicklingError: "),
    ([torch.zeros(2)], " holds an object of type list; expected a state dict"),
    ({"a": torch.zeros(2), "b": 3}, ": entry 'b' is of type int; expected a state dict"),
])
def test_stage3_command_refuses_a_garbage_pth_in_one_line(tmp_path, capsys, content, message):
    stage2_dir(tmp_path / "in", MODEL)
    vae = tmp_path / "vae.pth"
    vae.write_bytes(content) if isinstance(content, bytes) else torch.save(content, vae)
    before = sorted(p.name for p in (tmp_path / "in").iterdir())
    refused(stage3.main, ["--input_dir", str(tmp_path / "in"), "--vae_path", str(vae)],
                      capsys, f"--vae_path {vae}{message}")
    assert sorted(p.name for p in (tmp_path / "in").iterdir()) == before
