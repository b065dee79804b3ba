"""torchax 0.0.13 under torch 2.13 through compat.torchax_compat (see its removal condition)."""

import pytest
import torch

from compat.torchax_compat import (
    _NAMED_OVERLOAD,
    _named_overloads_tolerated,
    import_torchax,
    patched_overloads,
)


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


# torch 2.11 (the lent GPU machine's) still has the named-tensor overloads: torchax imports
# without the shim there, which stands in for nothing
TORCH_HAS_NAMED = hasattr(torch.ops.aten.all, "dimname")


def test_the_shim_stood_in_only_for_named_tensor_overloads_and_is_gone_after():
    """What the shim did when torchax was imported: on 0.0.13 it stood in for the named-tensor
    overloads torchax names and torch 2.13 lacks (each really missing from torch); on a newer
    torchax, which names none, it stands in for nothing (then remove compat/torchax_compat.py).
    Either way, after the import torch's op lookup is its own again."""
    import_torchax()
    for name in patched_overloads:
        packet, overload = name.removeprefix("aten::").split(".", 1)
        assert _NAMED_OVERLOAD.search(overload), name
        assert not hasattr(getattr(torch.ops.aten, packet), overload), f"torch has {name}"
    if torchax_version() > (0, 0, 13) or TORCH_HAS_NAMED:
        assert patched_overloads == [], "this torchax imports without compat/torchax_compat.py"
    else:
        # the 22 named-tensor overloads of its amp and decomposition tables (google/torchax#102)
        assert len(patched_overloads) == 22, patched_overloads
    _assert_lookup_is_torchs()


@pytest.mark.skipif(TORCH_HAS_NAMED, reason="torch < 2.13 keeps the named-tensor overloads")
def test_inside_the_shim_only_a_missing_named_overload_resolves_to_a_placeholder():
    before = list(patched_overloads)
    try:
        with _named_overloads_tolerated():
            stand_in = torch.ops.aten.all.dimname  # removed in torch 2.13, a Dimname overload
            assert "removed overload aten::all.dimname" in repr(stand_in)
            assert torch.ops.aten.all.dim is not stand_in  # a present overload is torch's own
            with pytest.raises(AttributeError):
                torch.ops.aten.all.not_an_overload  # noqa: B018 - missing and not named-tensor
        assert patched_overloads == [*before, "aten::all.dimname"]
    finally:
        patched_overloads[:] = before
    _assert_lookup_is_torchs()


def _assert_lookup_is_torchs():
    if TORCH_HAS_NAMED:
        return
    with pytest.raises(AttributeError):
        torch.ops.aten.all.dimname  # noqa: B018 - the shim's lookup did not outlive it


def torchax_version():
    import torchax
    return tuple(int(p) for p in torchax.__version__.split(".")[:3])
