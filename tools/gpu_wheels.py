"""Gather the wheels the lent GPU machine lacks, and check they travel with the tree.

    python -m tools.gpu_wheels [--dest gpu-wheels]

The machine (Python 3.12, torch 2.11 and jax 0.11.2 for CUDA 13, flax, transformers 5.17,
safetensors, numpy, imageio, tqdm) reaches no package index, and the device tool carries at
most 64 MiB: the tracked tree plus the ignored paths named in `carry`. This downloads CARRY for
CPython 3.12 on x86-64 Linux into --dest (ignored by git), prints each wheel with its size and
the total beside the tracked tree, and exits 1 if they would not fit. There:

    pip install --no-index --find-links gpu-wheels torchax==0.0.13 diffusers==0.42.1 && python -m bench.gpu

(pip takes a dependency from the wheels only where the machine's own copy does not satisfy it).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 64 * 2**20  # what one device call carries: tree and carried paths together
# torchax and diffusers, and the dependencies of diffusers that the machine's list does not
# name (transformers 5 brings huggingface-hub, filelock, regex and safetensors; Pillow comes
# with imageio); one wheel more than needed costs little, one missing stops the install there
CARRY = ("torchax==0.0.13", "diffusers==0.42.1", "importlib_metadata", "zipp", "requests",
         "charset-normalizer", "idna", "urllib3", "certifi")


def tracked_bytes() -> int:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.split(b"\0")
    return sum((ROOT / n.decode()).stat().st_size for n in names if n and (ROOT / n.decode()).is_file())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.gpu_wheels", description=__doc__.splitlines()[0])
    ap.add_argument("--dest", type=Path, default=ROOT / "gpu-wheels")
    args = ap.parse_args(argv)
    args.dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--platform", "manylinux_2_28_x86_64",
                    "-d", str(args.dest), *CARRY], check=True)
    wheels = sorted(args.dest.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels)
    tree = tracked_bytes()
    for w in wheels:
        print(f"{w.stat().st_size / 2**20:7.2f} MiB  {w.name}")
    fits = tree + total <= LIMIT
    print(f"wheels {total / 2**20:.1f} MiB + tracked tree {tree / 2**20:.1f} MiB = "
          f"{(tree + total) / 2**20:.1f} MiB: {'fits' if fits else 'does NOT fit'} the "
          f"{LIMIT / 2**20:.0f} MiB a device call carries")
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
