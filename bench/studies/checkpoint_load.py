"""Checkpoint loading: wall time and peak resident memory against the size of the weights.

Saves a mid-size random Wan-architecture DiT (official layout, sharded), then loads it in fresh
processes three ways and prints the peak RSS each added over the process's baseline:
  ours        modules.checkpoint.load_model (meta model, tensors read one by one, assigned)
  ours-bf16   the same with dtype=bfloat16 (fp32 islands kept)
  naive       build the model with real init, read the whole file dict, load_state_dict (copy)

    python -m bench.studies.checkpoint_load [--dim 1024 --layers 8]

Peak RSS counts the pages of the shard being read (safetensors maps the file; those pages are
file-backed and reclaimable), so a cast load peaks near model + one shard, not model x 2.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, {root!r})
import torch
from modules import checkpoint
from modules.registry import build_model
from modules.wan import WanConfig

def rss_mb():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096 / 2**20

mode, path, cfg = sys.argv[1], sys.argv[2], WanConfig(**json.loads(sys.argv[3]))
base = rss_mb()
t0 = time.perf_counter()
if mode == "naive":
    from safetensors.torch import load_file
    model = build_model(cfg)
    state = {{}}
    for f in checkpoint.checkpoint_files(path):
        state.update(load_file(f))
    model.load_state_dict(state, strict=True)
    del state
else:
    dtype = torch.bfloat16 if mode == "ours-bf16" else None
    model, _ = checkpoint.load_model(path, cfg, dtype=dtype)
seconds = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
print(json.dumps(dict(mode=mode, seconds=seconds, peak_added_mb=peak - base,
                      model_mb=weights)))
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from modules.checkpoint import save_checkpoint
    from modules.registry import build_model, config_dict
    from modules.wan import WanConfig

    cfg = WanConfig(dim=args.dim, ffn_dim=4 * args.dim, num_layers=args.layers,
                    num_heads=args.dim // 128, in_dim=36, out_dim=16, model_type="i2v")
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(cfg)
        path = save_checkpoint(model, Path(tmp) / "ckpt", max_shard_bytes=256 * 2**20)
        files = sorted(p.name for p in path.iterdir())
        del model
        size_mb = sum(p.stat().st_size for p in path.iterdir()) / 2**20
        print(f"checkpoint: {size_mb:.0f} MB on disk in {len(files) - 2} shards (+index, config)")
        print(f"{'mode':10s} {'seconds':>8s} {'model MB':>9s} {'peak added MB':>14s} {'peak/model':>10s}")
        for mode in ("ours", "ours-bf16", "naive"):
            code = CHILD.format(root=str(ROOT))
            out = subprocess.run([sys.executable, "-c", code, mode, str(path),
                                  json.dumps(config_dict(cfg))],
                                 check=True, capture_output=True, text=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            print(f"{r['mode']:10s} {r['seconds']:8.2f} {r['model_mb']:9.0f} "
                  f"{r['peak_added_mb']:14.0f} {r['peak_added_mb'] / r['model_mb']:10.2f}")
    print(f"machine: {time.strftime('%Y-%m-%d')}, CPU only; peak RSS from getrusage")


if __name__ == "__main__":
    main()
