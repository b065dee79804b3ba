"""What bench/tpu_pages/aot.py's page is printed from: the `python -m commands.aot` reports kept under
bench/results/tpu_aot/, one compile run a row (reused unless rerun), and the cell helpers the
stage-2 and the decode tables share."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from sampling.journal import atomic_write

ROOT = Path(__file__).resolve().parents[2]
CACHE = "--enable_cache"  # DeepCache: a schedule known before the run, so the roofline is exact

OUT = ROOT / "bench" / "results" / "tpu_aot"


BEFORE = OUT / "unrolled"  # reports compiled before the middle stage became a scan


ONE_PROGRAM = OUT / "one_program"  # decode reports from before each call became a chain




COMPILED = "compiled"  # the report's record of when, on how many cores and at what load (run_row)


def version(package: str) -> str:
    """The installed version: the reports do not record the compiler they were compiled with."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def read_report(name: str, folder: Path = OUT) -> dict | None:
    """A `commands.aot` / `commands.vae_aot` report this bench kept, None if there is none."""
    path = folder / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def wrap(text: str) -> list[str]:
    """A paragraph as the page's lines (names with hyphens kept whole)."""
    return textwrap.wrap(text, 92, break_on_hyphens=False, break_long_words=False)


def run_row(name: str, args: str, rerun: bool, module: str = "commands.aot") -> dict:
    """One row's report: `python -m <module> <args> --json`, reused unless `rerun`."""
    path = OUT / f"{name}.json"
    if path.exists() and not rerun:
        return json.loads(path.read_text())
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    began, load_start = time.perf_counter(), os.getloadavg()[0]
    extra = CACHE.split() if module == "commands.aot" else []
    out = subprocess.run([sys.executable, "-m", module, *args.split(), *extra, "--json", str(path)],
                         cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{name}: {module} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    atomic_write(str(OUT / f"{name}.txt"), lambda f: f.write(out.stdout))
    print(f"{name}: {time.perf_counter() - began:.0f} s", file=sys.stderr)
    # compile seconds mean little without the machine's state: the page prints this record
    report = json.loads(path.read_text())
    report[COMPILED] = {"date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(),
                        "load_start": round(load_start, 2), "load_end": round(os.getloadavg()[0], 2)}
    atomic_write(str(path), lambda f: f.write(json.dumps(report, indent=1) + "\n"))
    return report


def per_device(chip: dict) -> str:
    """Where a JAX device is less than a chip (v7x: one TensorCore), the row's figures are per
    device: said in its slice cell."""
    n = chip.get("devices_per_chip", 1)
    return "" if n == 1 else f" a device, {n} a chip"


def load_or_run(name: str, row_args: str, compile_it: bool, rerun: bool,
                 module: str = "commands.aot") -> dict | None:
    """The row's report: compiled where asked (an existing one reused unless `rerun`), else the
    report on disk, None if there is none."""
    return run_row(name, row_args, rerun, module) if compile_it else read_report(name)
