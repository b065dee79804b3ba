"""torchax 0.0.13 under torch 2.13 through compat.torchax_compat (see its removal condition)."""

import torch

from compat.torchax_compat import _NAMED_OVERLOAD, import_torchax, patched_overloads


def test_torchax_imports_and_runs_a_jitted_module():
    torchax = import_torchax()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.LayerNorm(8))
    x = torch.randn(2, 8)
    expected = model(x).detach()
    env = torchax.default_env()
    with env, torch.no_grad():
        jitted = torchax.compile(model.to("jax"))
        out = jitted(x.to("jax")).cpu()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_the_shim_stood_in_only_for_named_tensor_overloads_and_is_gone_after():
    import_torchax()
    if torchax_version() > (0, 0, 13):
        assert not patched_overloads, "torchax no longer needs compat/torchax_compat.py: remove it"
    assert patched_overloads, "torchax 0.0.13 names removed overloads; the shim should have seen them"
    assert all(_NAMED_OVERLOAD.search(name.split(".", 1)[1]) for name in patched_overloads)
    assert not hasattr(torch.ops.aten.all, "dimname"), "torch regained Dimname overloads, or the shim leaked"


def torchax_version():
    import torchax
    return tuple(int(p) for p in torchax.__version__.split(".")[:3])
