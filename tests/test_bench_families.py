"""Issue 63: what a family does differently in bench/ is its own record, found by the family's
name in modules.registry; no code in bench/ asks a family's name with a string comparison."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench.fixtures import families as F
from bench.tpu_pages import stage1_work as s1
from modules import registry

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_each_table_is_keyed_by_the_registrys_family_names():
    assert set(F.FAMILIES) <= set(registry.FAMILIES)
    assert set(s1.STAGE1_TASKS) == set(s1.STAGE1_WORK) <= set(registry.FAMILIES)
    # the model card quotes each family's item of the fixtures' module doc
    assert F.FAMILIES["wan"].about.startswith("Wan2.2 TI2V: image mode keeps frame 0 clean")
    assert F.FAMILIES["hunyuan_video15"].about.startswith("HunyuanVideo-1.5: the text states")


def test_the_pareto_families_are_named_as_the_registry_names_them():
    pytest.importorskip("diffusers")
    from bench.pareto import peers
    from bench.pareto import workload as pw

    fams = pw.families(1, 1)
    # selected by label (the --families values, file names, result rows); named as the registry
    assert {k: (f.label, f.name) for k, f in fams.items()} == {
        "wan": ("wan", "wan"), "hunyuan": ("hunyuan", "hunyuan_video15")}
    assert {f.name for f in fams.values()} == set(peers.DIFFUSERS_FAMILIES) <= set(registry.FAMILIES)
    assert [f.remodulates for f in fams.values()] == [True, False]  # Wan2.2's shared time gates


def test_no_family_name_is_compared_as_a_string_in_bench():
    name = r"""['"](wan|hunyuan\w*)['"]"""  # a family's name or label as a string
    ladder = re.compile(rf"""[!=]=\s*{name}|{name}\s*[!=]=|family\w*(\(\w*\))?(\.\w+)*\s*[!=]=\s*['"]""")
    found = [f"{p.relative_to(BENCH)}:{i}: {line.strip()}"
             for p in sorted(BENCH.rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if ladder.search(line)]
    assert not found, "\n".join(found)
