"""The GKE manifest of one prompt list over several slices runs the command docs/tpu.md shows,
that command parses, and the manifest's pieces fit together (a shared ReadWriteMany folder
holding what the command reads and writes, hosts x chips a host = the slice's topology)."""

from __future__ import annotations

import math
import re
import shlex
from pathlib import Path

import yaml

from commands import generate

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "deploy" / "gke" / "batch-jobset.yaml"


def _documents() -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all(MANIFEST.read_text())}


def _documented_command() -> list[str]:
    text = (ROOT / "docs" / "tpu.md").read_text()
    section = text.split("## One prompt list over several slices", 1)[1].split("\n## ", 1)[0]
    assert "deploy/gke/batch-jobset.yaml" in section
    blocks = re.findall(r"every pod runs\n\n```sh\n(.*?)\n```", section, re.S)
    assert len(blocks) == 1, blocks
    return shlex.split(blocks[0])


def test_the_manifest_runs_the_documented_command_and_it_parses():
    docs = _documents()
    assert set(docs) == {"PersistentVolumeClaim", "JobSet"}
    job = docs["JobSet"]["spec"]["replicatedJobs"][0]["template"]["spec"]
    pod = job["template"]["spec"]
    [container] = pod["containers"]
    command = container["command"]
    assert command == _documented_command()
    assert command[:2] == ["python", "generate.py"]
    args = generate.build_parser().parse_args(command[2:])
    assert args.multihost and args.prompts and args.output_dir and args.enable_cache
    # the prompts, videos, checkpoints and compile cache live on the share every pod mounts
    [mount] = container["volumeMounts"]
    [volume] = pod["volumes"]
    assert volume["name"] == mount["name"]
    claim = docs["PersistentVolumeClaim"]
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    for path in (args.prompts, args.output_dir, args.model_path, args.compile_cache_dir):
        assert path.startswith(mount["mountPath"] + "/"), path
    # one Job a slice: its hosts x chips a host make the slice's topology, all of them in
    # the sequence axis
    chips = math.prod(int(n) for n in
                      pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"].split("x"))
    assert job["parallelism"] == job["completions"]
    assert job["parallelism"] * container["resources"]["limits"]["google.com/tpu"] == chips
    assert args.sp_size == chips
    assert job["completionMode"] == "Indexed" and pod["restartPolicy"] == "Never"
