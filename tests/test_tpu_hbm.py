"""The HBM traffic count of a compiled program (tpu/hbm.py): memory spaces, the asynchronous
copies of the compiler's memory-space assignment, slices, fusions that slice a parameter, loops;
on a real deviceless TPU compile and on a CPU program, where everything lives in one memory."""

import jax
import jax.numpy as jnp
import pytest

from tpu.hbm import hbm_traffic, instruction, leaves
from tpu.topology import topology_devices

KB = 4096  # bytes of f32[1024]

HLO = "\n".join([
    "HloModule m",
    "%fused_slice (p0: f32[10,1024], p1: s32[]) -> f32[1,1024] {",
    "  %p0 = f32[10,1024]{1,0} parameter(0)",
    "  %p1 = s32[] parameter(1)",
    "  %z = s32[] constant(0)",
    "  ROOT %ds = f32[1,1024]{1,0} dynamic-slice(%p0, %p1, %z), dynamic_slice_sizes={1,1024}",
    "}",
    "%fused_update (q0: f32[10,1024], q1: f32[1,1024], q2: s32[]) -> f32[10,1024] {",
    "  %q0 = f32[10,1024]{1,0} parameter(0)",
    "  %q1 = f32[1,1024]{1,0} parameter(1)",
    "  %q2 = s32[] parameter(2)",
    "  %z = s32[] constant(0)",
    "  ROOT %dus = f32[10,1024]{1,0} dynamic-update-slice(%q0, %q1, %q2, %z)",
    "}",
    "%body (p: (s32[], f32[10,1024], f32[1,1024])) -> (s32[], f32[10,1024], f32[1,1024]) {",
    "  %p = (s32[], f32[10,1024]{1,0}, f32[1,1024]{1,0}) parameter(0)",
    "  %i = s32[]{:S(2)} get-tuple-element(%p), index=0",
    "  %w = f32[10,1024]{1,0} get-tuple-element(%p), index=1",
    "  %f = f32[1,1024]{1,0} fusion(%w, %i), kind=kLoop, calls=%fused_slice",
    "  %u = f32[10,1024]{1,0} fusion(%w, %f, %i), kind=kLoop, calls=%fused_update",
    "  ROOT %t = (s32[], f32[10,1024]{1,0}, f32[1,1024]{1,0}) tuple(%i, %u, %f)",
    "}",
    "ENTRY %main (a: f32[1024], w: f32[10,1024]) -> f32[1024] {",
    "  %a = f32[1024]{0:T(1024)} parameter(0)",
    "  %w0 = f32[10,1024]{1,0:T(8,128)} parameter(1)",
    "  %cs = (f32[1024]{0:T(1024)}, f32[1024]{0:T(1024)S(1)}, u32[]{:S(2)}) copy-start(%a)",
    "  %cd = f32[1024]{0:T(1024)S(1)} copy-done(%cs)",
    "  %m = f32[1024]{0:T(1024)S(1)} multiply(%cd, %cd)",
    "  %o = f32[1024]{0:T(1024)} add(%m, %a)",
    "  %ss = ((f32[10,1024]{1,0:T(8,128)}), f32[2,1024]{1,0:T(8,128)S(1)}, s32[]{:S(2)}) "
    "slice-start(%w0), slice={[0:2], [0:1024]}",
    "  %t0 = (s32[], f32[10,1024]{1,0}, f32[1,1024]{1,0}) tuple(%z, %w0, %f0)",
    "  %loop = (s32[], f32[10,1024]{1,0}, f32[1,1024]{1,0}) while(%t0), condition=%cond, "
    "body=%body, backend_config={\"known_trip_count\":{\"n\":\"5\"}}",
    "  ROOT %r = f32[1024]{0:T(1024)} copy(%o)",
    "}",
])


def test_counts_hbm_sides_slices_fusions_and_loop_iterations():
    expected = (
        KB  # copy-start: reads the HBM operand; its VMEM side is free
        + 0  # multiply: both operands and its result in VMEM
        + 2 * KB  # add: reads %a from HBM, writes %o
        + 2 * KB  # slice-start: reads two rows (not the buffer), the slice lands in VMEM
        + 5 * (2 * KB  # the body's slicing fusion: one row read, one written
               + 2 * KB)  # the in-place update: the row in, the row written; the rest untouched
        + 2 * KB  # the root copy
    )
    assert hbm_traffic(HLO) == expected


def test_parses_tuple_results_and_operands():
    name, shape, op, operands, _ = instruction(
        "  %ss = ((f32[10,1024]{1,0}), f32[2,1024]{1,0:T(8,128)S(1)}, s32[]{:S(2)}) "
        "slice-start(%w0), slice={[0:2], [0:1024]}")
    assert (name, op, operands) == ("ss", "slice-start", ["w0"])
    assert leaves(shape) == [(40960, 0), (8192, 1), (4, 2)]
    assert instruction("}") is None


@pytest.fixture(scope="module")
def v6e_chip():
    return topology_devices("v6e:2x2")[1][0]


def test_a_tpu_program_reads_its_input_and_writes_its_output_once(v6e_chip):
    """A fused elementwise program on a real compile for one v6e chip: 64 MiB in, 64 MiB out;
    XLA's cost analysis counts the same bytes, the traffic count may not count more."""
    shape = jax.ShapeDtypeStruct((4096, 4096), jnp.float32,
                                 sharding=jax.sharding.SingleDeviceSharding(v6e_chip))
    compiled = jax.jit(lambda x: jnp.tanh(x * 2.0 + 1.0)).lower(shape).compile()
    traffic = hbm_traffic(compiled.as_text())
    size = 4096 * 4096 * 4
    assert 2 * size <= traffic <= 2.05 * size
    assert traffic <= float(compiled.cost_analysis()["bytes accessed"]) * 1.01


def test_on_one_memory_it_is_the_cost_analysis_count():
    """On the CPU every buffer is in memory space 0: a fused program's traffic is XLA's bytes
    accessed (a loop of 3 iterations: XLA counts its body once, so the loop is left out)."""
    x = jnp.ones((256, 512), jnp.float32)
    compiled = jax.jit(lambda x, y: jnp.exp(x) * y + 1.0).lower(x, x).compile()
    assert hbm_traffic(compiled.as_text()) == pytest.approx(
        float(compiled.cost_analysis()["bytes accessed"]), rel=0.02)


def test_command_prints_the_traffic_by_kind_and_refuses_a_missing_file(tmp_path, capsys):
    from tpu.hbm import main
    path = tmp_path / "program.txt"
    path.write_text(HLO)
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "HBM traffic" in out and "fusion:kLoop" in out and "copy-start" in out
    assert main([str(tmp_path / "missing.txt")]) == 2
    assert "missing.txt" in capsys.readouterr().err
    path.write_text("not a program")
    assert main([str(path)]) == 2
    assert "no ENTRY computation" in capsys.readouterr().err
