"""Loading a checkpoint onto 8 emulated CPU devices: the old path against sharded loading.

    python -m bench.tpu_pages.load [--model wan2.2-ti2v-5b] [--layers N] [--dir DIR --keep]
                         [--hold block|all] [--cache cold|warm] [--threads N] [--out PAGE]

Writes a checkpoint of `--model` (default the real-size Wan2.2 TI2V-5B: ~10 GB) in the official
layout the loader reads, bf16 random values, in shards of at most 4 GiB with an index, into a
temporary folder under /tmp (deleted after; `--dir D --keep` writes it there once and reuses
it). Then, in a fresh process per path (8 emulated devices, mesh sp 8, FSDP: the backend's
default there), it loads it:

  old  the path before issue 24: `load_model` reads the whole model into host memory (bf16), then
       each weight goes whole onto the first device through torchax's fp32 copy and is resharded
       (`tpu/backend.py` `_place_weight` at ac084af, reproduced below as the baseline)
  new  `open_checkpoint` + `tpu.loading.place_all` (what the JAX backend runs): each device's rows
       read from the files, cast on the host, put on that device alone, on a thread pool

and prints load seconds and the child's peak RSS (getrusage ru_maxrss), with the bytes read and
the bytes the weights take on the devices. `--out` (bench/results/load.md by default) gets the
run's section of the page, named by its command: its table, the machine it ran on, and the
ratios computed from its rows; the sections of other variants stay as their runs wrote them.

On emulated CPU devices the devices' memory is this process's memory, so a load that keeps every
weight holds the whole model in RSS whatever the loader does (on a TPU host it is HBM).
`--hold block` (default) places the weights one block at a time, waits for them and releases
them before the next, so the peak is what the loader itself holds on the host; `--hold all`
keeps everything placed (for sizes that fit this machine twice). `--cache cold` (default)
drops the checkpoint's pages from the page cache before each path (posix_fadvise on the files
only), so each path reads from disk.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sampling.units import size_text  # noqa: E402

OUT = ROOT / "bench" / "results" / "load.md"
SHARD_BYTES = 4 * 2 ** 30
DEVICES = 8


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _buffer_bytes(arrays: dict) -> int:
    """Bytes of the distinct device buffers behind some arrays (on CPU, replicas of a weight
    may share one host buffer)."""
    buffers = {s.data.unsafe_buffer_pointer(): s.data.nbytes
               for a in arrays.values() for s in a.addressable_shards}
    return sum(buffers.values())


def _gb(n: float) -> str:
    return size_text(n, "GB", 2)


# --- the checkpoint --------------------------------------------------------------------------------

def _config(args):
    from modules.registry import get_config
    config = get_config(args.model)
    return dataclasses.replace(config, num_layers=args.layers) if args.layers else config


def checkpoint_bytes(config) -> int:
    from modules.registry import build_model
    return sum(p.numel() * 2 for p in build_model(config, meta=True).parameters())


def write_checkpoint(config, directory: Path, seed: int = 0) -> None:
    """The official layout (our parameter names), bf16 random values (std 0.02), one tensor in
    memory at a time: headers first, then each tensor's bytes as it is drawn."""
    import torch

    from modules.checkpoint import INDEX_NAME, config_to_json
    from modules.layouts import OFFICIAL
    from modules.registry import build_model

    shapes = {k: tuple(p.shape) for k, p in build_model(config, meta=True).named_parameters()}
    shards, size = [[]], 0
    for key in sorted(shapes):
        nbytes = math.prod(shapes[key]) * 2
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    gen = torch.Generator().manual_seed(seed)
    weight_map = {}
    for i, keys in enumerate(shards, 1):
        name = f"diffusion_pytorch_model-{i:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for key in keys:
            nbytes = math.prod(shapes[key]) * 2
            header[key] = {"dtype": "BF16", "shape": list(shapes[key]),
                           "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(tmp / name, "wb") as fh:
            fh.write(len(raw).to_bytes(8, "little") + raw)
            for key in keys:
                value = (torch.randn(shapes[key], generator=gen) * 0.02).to(torch.bfloat16)
                fh.write(value.view(torch.uint16).numpy().tobytes())
                weight_map[key] = name
    total = sum(math.prod(s) * 2 for s in shapes.values())
    (tmp / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total},
                                              "weight_map": weight_map}, indent=1))
    (tmp / "config.json").write_text(json.dumps(config_to_json(config, OFFICIAL), indent=1))
    os.replace(tmp, directory)


def drop_page_cache(directory: Path) -> None:
    for file in directory.glob("*.safetensors"):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# --- one path, in a fresh process ---------------------------------------------------------------

def child(args) -> dict:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"
    import jax
    import torch

    from compat.torchax_compat import import_torchax
    from modules.checkpoint import load_model, open_checkpoint
    from modules.registry import build_model
    from sharding.jax_sp import JaxSequenceLayout, make_mesh
    from tpu import loading

    config = _config(args)
    mesh = make_mesh(DEVICES, 1)
    layout = JaxSequenceLayout(mesh, "jax_dpa", "fsdp")  # the backend's weight rule on this mesh
    template = build_model(config, meta=True)
    env = import_torchax().default_env()
    jax.block_until_ready(jax.device_put(jax.numpy.zeros(8), layout.replicated()))  # JAX started
    groups: dict = {}
    for name, _ in template.named_parameters():
        groups.setdefault(template.block_of(name), []).append(name)
    baseline = _rss_bytes()

    began = time.perf_counter()
    kept, device_bytes, bytes_read = [], 0, 0
    if args.child == "new":
        model, reader, _ = open_checkpoint(args.path, config, dtype=torch.bfloat16)
        params = dict(model.named_parameters())
        with reader:
            for names in groups.values():
                specs = {n: loading.WeightSpec(tuple(params[n].shape), params[n].dtype,
                                               layout.weight_sharding(tuple(params[n].shape),
                                                                      template.block_of(n) is not None))
                         for n in names}
                placed = jax.block_until_ready(loading.place_all(specs, reader.read, args.threads))
                device_bytes += _buffer_bytes(placed)
                if args.hold == "all":
                    kept.append(placed)
                del placed
            bytes_read = reader.bytes_read
    else:
        model, _ = load_model(args.path, config, dtype=torch.bfloat16)
        params = dict(model.named_parameters())
        bytes_read = checkpoint_bytes(config)  # every tensor, whole
        with torch.no_grad():
            for names in groups.values():
                placed = {}
                for n in names:  # tpu/backend.py _place_weight before issue 24
                    array = env.t2j_copy(params[n].detach())
                    sharding = layout.weight_sharding(tuple(params[n].shape),
                                                      template.block_of(n) is not None)
                    placed[n] = jax.device_put(array, sharding)
                jax.block_until_ready(placed)
                device_bytes += _buffer_bytes(placed)
                if args.hold == "all":
                    kept.append(placed)
                del placed
    seconds = time.perf_counter() - began
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"path": args.child, "seconds": seconds, "peak_rss": peak, "baseline_rss": baseline,
            "bytes_read": bytes_read, "device_bytes": device_bytes, "jax": jax.__version__,
            "threads": (args.threads or loading.default_threads()) if args.child == "new" else None}


def host_bytes(directory: Path, config) -> int:
    """Bytes the old path's model takes in host memory: the dtypes a bf16 load gives (the fp32
    islands kept), read from the checkpoint's headers."""
    import torch

    from modules.checkpoint import load_model
    model, _ = load_model(directory, config, dtype=torch.bfloat16, meta=True)
    return sum(p.numel() * p.element_size() for p in model.parameters())


# --- the comparison ----------------------------------------------------------------------------

def _available_memory() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def table(rows, size: int, hold: str, cache: str) -> list[str]:
    """The summary the bench prints, one line per path."""
    out = [f"{DEVICES} emulated CPU devices, mesh sp {DEVICES} (FSDP), hold {hold}, "
           f"page cache {cache}; checkpoint {_gb(size)}",
           f"{'path':5s} {'seconds':>8s} {'peak RSS':>10s} {'RSS before':>11s} {'read':>10s} "
           f"{'on devices':>11s} {'peak/ckpt':>10s}"]
    for r in rows:
        out.append(f"{r['path']:5s} {r['seconds']:8.1f} {_gb(r['peak_rss']):>10s} "
                   f"{_gb(r['baseline_rss']):>11s} {_gb(r['bytes_read']):>10s} "
                   f"{_gb(r['device_bytes']):>11s} {r['peak_rss'] / size:10.2f}")
    return out


def readings(rows, size: int, host: int, hold: str, cache: str) -> list[str]:
    """What the rows say, every figure computed from them: the paths against each other where
    both ran, each path's peak against the checkpoint, and the old path's host model."""
    by = {r["path"]: r for r in rows}
    out = []
    old, new = by.get("old"), by.get("new")
    if old and new:
        speed = old["seconds"] / new["seconds"]
        out.append(f"Sharded loading: {speed:.1f}x {'faster' if speed >= 1 else 'slower'} than the old "
                   f"path from a {cache} page cache, and peak RSS {new['peak_rss'] / size:.2f}x the "
                   f"checkpoint ({_gb(new['peak_rss'])}, {_gb(new['baseline_rss'])} of it the process "
                   f"before loading), against {old['peak_rss'] / size:.2f}x ({_gb(old['peak_rss'])}).")
    else:
        out += [f"{r['path']}: {r['seconds']:.1f} s from a {cache} page cache, peak RSS "
                f"{r['peak_rss'] / size:.2f}x the checkpoint ({_gb(r['peak_rss'])}, "
                f"{_gb(r['baseline_rss'])} of it the process before loading)." for r in rows]
    if new:
        out.append(f"The new path read with {new['threads']} thread{'s' if new['threads'] != 1 else ''}.")
    if old:
        text = (f"The old path holds the whole model in host memory: {_gb(host)} with the fp32 "
                "islands (the dtypes a bf16 load gives, from the checkpoint's headers)")
        if hold == "block":  # else the placed weights count in RSS too: no such split
            above = old["peak_rss"] - old["baseline_rss"]
            text += f"; its peak RSS is {_gb(above)} above the process before loading"
            if above > host:
                text += (f", {_gb(above - host)} more than the model: the pages of the shard being "
                         "read, which count while safetensors maps it")
        out.append(text + ".")
    return out


def section(rows, *, cmd: str, model: str, layers, size: int, shards: int, host: int, hold: str,
            cache: str, wrote_s, ram: int, loads, date: str) -> list[str]:
    """One run's section of the page: what it loaded, where, its table and its readings."""
    jax = ", ".join(sorted({r["jax"] for r in rows}))
    written = f"written for this run in {wrote_s:.0f} s" if wrote_s is not None else "reused from --dir"
    return [f"## `{cmd}`", "",
            f"Checkpoint: {model}{f' ({layers} blocks)' if layers else ''}, {_gb(size)} bf16 in "
            f"{shards} shard{'s' if shards != 1 else ''} ({written}). Page cache {cache}"
            + (" (the files' pages dropped before each path)" if cache == "cold" else "")
            + f"; hold {hold}.", "",
            f"Machine: {os.cpu_count()} CPUs, {ram / 1e9:.1f} GB RAM, jax {jax} on CPU, {date}; "
            f"1-minute load average {loads[0]:.2f} at the start, {loads[1]:.2f} at the end (other "
            "jobs on the machine move the seconds).", "",
            "```", *table(rows, size, hold, cache), "```", "",
            " ".join(readings(rows, size, host, hold, cache))]


def head() -> str:
    """The page's top: what the paths are and what the columns mean (no measured figure)."""
    return f"""\
# bench/tpu_pages/load.py

Loading a checkpoint (random bf16 values, official layout and keys, shards of at most
{SHARD_BYTES / 2 ** 30:g} GiB with an index) onto {DEVICES} emulated CPU devices, mesh sp {DEVICES},
FSDP (the backend's default there), each path in a fresh process:

- **old**: the path before issue 24. `load_model` reads the whole model into host memory (bf16,
  fp32 islands), then each weight goes whole onto the first device through torchax's fp32 copy
  and is resharded (`tpu/backend.py` `_place_weight` at ac084af, reproduced in the bench).
- **new**: `open_checkpoint` + `tpu.loading.place_all`, what the JAX backend now runs: each
  device's rows read from the files (positional reads, on a pool of threads), cast on the host,
  put on that device alone.

Each section below is written by the run its heading names (`--out`, this page by default); a
run replaces its own section and keeps the others, so a variant (`--cache warm`, `--threads N`,
`--hold all`, `--layers N`) sits beside the default run with its own machine line. Peak RSS is
the child's getrusage ru_maxrss (mapped file pages count while mapped).

**What "hold block" means.** An emulated CPU device's memory is the process's own, so a load that
keeps every weight has the whole model in RSS whatever the loader does (on a TPU host it is in
HBM). The bench therefore places one block at a time, waits for it, counts the device buffers
("on devices", the sum over the run) and releases them before the next block: the peak is what
the loader itself holds on the host. A run that keeps everything (`--hold all`) fits only where
the machine holds the model twice over (smaller files: `--layers N`).

"On devices" counts distinct device buffers: on CPU, jax keeps an aligned host buffer as the
device buffer instead of copying it, so the {DEVICES} replicas of an fp32 island that the reader cast
on the host share one buffer; the bf16 weights read straight from the file are copied to each
device. On a TPU every replica is a transfer to HBM either way.

Per host on a slice: each process reads only its devices' rows, so with FSDP over two hosts each
reads the replicated weights whole and half of every split block weight
(`tests/test_multihost.py` counts every read of both processes against exactly that).
"""


DEFAULTS = {"model": "wan2.2-ti2v-5b", "layers": None, "paths": "old,new", "hold": "block",
            "cache": "cold", "threads": None}


def command(args) -> str:
    """The run's command: its flags that change what is measured (not where files go)."""
    from bench.page import command_line  # lazily: the parent loads no model stack
    return command_line("bench.tpu_pages.load", args, DEFAULTS)


def _rank(key: str) -> int:
    return 0 if key == "python -m bench.tpu_pages.load" else 1  # the default run first, variants after


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULTS["model"], help="a model config name (default: "
                        "the real-size Wan2.2 TI2V-5B)")
    parser.add_argument("--layers", type=int, help="fewer blocks than the config (a smaller file)")
    parser.add_argument("--dir", help="where the checkpoint goes (default: a temporary folder "
                        "under /tmp, deleted after)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint in --dir, and "
                        "reuse one already there")
    parser.add_argument("--paths", default=DEFAULTS["paths"], help="which loaders, in order")
    parser.add_argument("--hold", choices=("block", "all"), default=DEFAULTS["hold"])
    parser.add_argument("--cache", choices=("cold", "warm"), default=DEFAULTS["cache"])
    parser.add_argument("--threads", type=int, help="new path's reading threads (default: "
                        "tpu.loading's)")
    parser.add_argument("--out", default=str(OUT), help="the results page whose section (named by "
                        "the run's command) this run writes ('' for none)")
    parser.add_argument("--child", choices=("old", "new"), help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return 0
    if args.keep and not args.dir:
        parser.error("--keep needs --dir (the folder to keep the checkpoint in)")

    config = _config(args)
    size = checkpoint_bytes(config)
    directory = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench-load-", dir="/tmp"))
    directory.mkdir(parents=True, exist_ok=True)
    ckpt = directory / "checkpoint"
    reuse = args.keep and ckpt.is_dir()
    free = shutil.disk_usage(directory).free
    load = os.getloadavg()[0]
    print(f"checkpoint: {args.model}{f' ({args.layers} blocks)' if args.layers else ''}, "
          f"{_gb(size)} bf16 in {ckpt}{' (reused)' if reuse else ''}; {_gb(free)} free there, "
          f"{_gb(_available_memory())} memory available")
    if not reuse and free < size * 1.05:
        print(f"not enough disk: the checkpoint needs {_gb(size)}, {_gb(free)} free in {directory}; "
              "give --dir on a larger disk", file=sys.stderr)
        return 1
    wrote = None
    try:
        if not reuse:
            began = time.perf_counter()
            write_checkpoint(config, ckpt)
            wrote = time.perf_counter() - began
            print(f"wrote it in {wrote:.0f} s")
        shards, host = len(list(ckpt.glob("*.safetensors"))), host_bytes(ckpt, config)
        rows = []
        for path in args.paths.split(","):
            if args.cache == "cold":
                drop_page_cache(ckpt)
            cmd = [sys.executable, "-m", "bench.tpu_pages.load", "--child", path, "--path", str(ckpt),
                   "--model", args.model, "--hold", args.hold]
            cmd += ["--layers", str(args.layers)] if args.layers else []
            cmd += ["--threads", str(args.threads)] if args.threads else []
            run = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                                 capture_output=True, text=True)
            if run.returncode:
                print(run.stderr[-3000:], file=sys.stderr)
                return 1
            rows.append(json.loads(run.stdout.strip().splitlines()[-1]))
            r = rows[-1]
            print(f"  {path}: {r['seconds']:.1f} s, peak RSS {_gb(r['peak_rss'])}", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)

    print()
    print("\n".join(table(rows, size, args.hold, args.cache)))
    print(f"machine: {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')}; peak RSS = the child's "
          "getrusage ru_maxrss (mapped file pages count while mapped)")
    if args.out:
        from bench.page import write_section  # a page of sections, one a run
        cmd = command(args)
        write_section(args.out, cmd, section(
            rows, cmd=cmd, model=args.model, layers=args.layers, size=size, shards=shards, host=host,
            hold=args.hold, cache=args.cache, wrote_s=wrote,
            ram=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            loads=(load, os.getloadavg()[0]), date=time.strftime("%Y-%m-%d")), head(), _rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
