"""Which JAX platform and torch device this host can give a run, checked before any model work.

Nothing imported at module level imports JAX or torch: `quiet_cpu_default` must run before JAX
is imported. jax, torch and the op registry are imported inside the checks that need them.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import subprocess
import sys

from .errors import UsageError

# JAX's own view of an accelerator's presence (jax/_src/hardware_utils.py): Google's PCI vendor id
# with a TPU device id, and the device nodes of the NVIDIA driver (WSL2 included).
_GOOGLE_PCI_VENDOR = "0x1ae0"
_TPU_PCI_DEVICES = {"0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076"}
_NVIDIA_NODES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")
_AMD_NODES = ("/dev/kfd", "/dev/dxg")

# tpu/attention.py's lowerings (importing it starts torchax, hence JAX); a test keeps them equal.
JAX_ATTENTION = ("jax_dpa", "splash", "splash_interpret")


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def tpu_evidence() -> list[str]:
    """What says a TPU is attached: the device nodes libtpu opens (/dev/accel*, or VFIO groups
    /dev/vfio/<n>, by generation) or a TPU on the PCI bus. Empty: none."""
    found = sorted(glob.glob("/dev/accel*"))
    found += sorted(p for p in glob.glob("/dev/vfio/*") if os.path.basename(p).isdigit())
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        if _read(vendor) == _GOOGLE_PCI_VENDOR and \
                _read(os.path.join(os.path.dirname(vendor), "device")) in _TPU_PCI_DEVICES:
            found.append(os.path.dirname(vendor))
    return found


def gpu_evidence() -> list[str]:
    return [p for p in dict.fromkeys(_NVIDIA_NODES + _AMD_NODES) if os.path.exists(p)]


def quiet_cpu_default() -> None:
    """With libtpu installed (jax[tpu]) and JAX_PLATFORMS unset, JAX opens libtpu on every run,
    and on a host with no TPU libtpu prints ~5 lines of setup noise on stderr before JAX falls
    back to the CPU. Where nothing but the CPU is here (no TPU, no GPU device node), say so up
    front: JAX_PLATFORMS=cpu is what JAX would have ended with, minus the noise. A TPU or GPU
    host, an explicit JAX_PLATFORMS (even empty: "choose for me") and JAX_FORCE_TPU_INIT are left
    alone; so is a process that imported JAX already (its platforms are read at import)."""
    if "JAX_PLATFORMS" in os.environ or "JAX_FORCE_TPU_INIT" in os.environ or "jax" in sys.modules:
        return
    if libtpu_noise_here():
        # the deviceless compiles still compile for TPUs: tpu.topology loads libtpu itself,
        # through jax.experimental.topologies
        os.environ["JAX_PLATFORMS"] = "cpu"


def libtpu_noise_here() -> bool:
    """libtpu is installed and this host has only a CPU: JAX's own platform search would open
    libtpu for nothing."""
    import importlib.util
    try:
        has_libtpu = importlib.util.find_spec("libtpu") is not None
    except (ImportError, ValueError):
        has_libtpu = False
    return has_libtpu and not tpu_evidence() and not gpu_evidence()


class PlatformError(UsageError):
    """A JAX platform or torch device this host does not have: a refusal like any bad flag."""


_UNSET_OR_CPU = "expected a platform this host has: unset JAX_PLATFORMS or set it to cpu"


def check_jax_platforms(*, probe: bool = True) -> None:
    """PlatformError unless JAX can start the platforms JAX_PLATFORMS names. A TPU asked for on
    a host without one is refused from the device nodes alone: asking JAX would first print
    libtpu's setup noise. Otherwise JAX is asked (`probe`; not before jax.distributed.initialize,
    which must come first on a multi-host slice): it fails loudly on each platform it cannot
    start, except CUDA, which it skips where no NVIDIA GPU is visible."""
    value = os.environ.get("JAX_PLATFORMS", "").strip()
    names = [p.strip().lower() for p in value.split(",") if p.strip()]
    if not names or names == ["cpu"]:
        return
    if "tpu" in names and not tpu_evidence() and "JAX_FORCE_TPU_INIT" not in os.environ:
        raise PlatformError(f"JAX_PLATFORMS={value}: no tpu device here (no /dev/accel*, "
                            f"/dev/vfio/<n> or TPU on the PCI bus); {_UNSET_OR_CPU}")
    if not probe:
        return
    import jax
    try:
        jax.devices()
    except AssertionError:  # JAX skipped every platform named (CUDA without a visible GPU)
        raise PlatformError(f"JAX_PLATFORMS={value}: no {'/'.join(names)} device here (JAX sees "
                            f"no NVIDIA GPU: none of {', '.join(_NVIDIA_NODES)}); "
                            f"{_UNSET_OR_CPU}") from None
    except RuntimeError as exc:
        first = (str(exc).splitlines() or [""])[0].split(" (set JAX_PLATFORMS=")[0]
        raise PlatformError(f"JAX_PLATFORMS={value}: JAX cannot start it ({first}); "
                            f"{_UNSET_OR_CPU}") from None


# XLA's log lines from its flag parsers: "F1128 10:32:57.58 2281 parse_flags_from_env.cc:234] ..."
_FLAG_LOG = re.compile(r"^([EF])\d{4} \S+\s+\d+ (?:parse_flags_from_env|command_line_flags)\.cc:\d+\] "
                       r"(.*)$", re.MULTILINE)
_XLA_FLAGS_READ: set[str] = set()  # values of XLA_FLAGS this process has found XLA can read
XLA_PROBE_TIMEOUT_S = 60.0


def check_xla_flags() -> None:
    """PlatformError unless XLA can read XLA_FLAGS. XLA reads it when JAX starts its first
    backend, and on anything it cannot read (no --flag and no file of flags, a flag it does not
    know, a value not of the flag's type) it logs a fatal line and aborts the process, exit 1,
    before any check of ours. The flags XLA knows are listed nowhere but in XLA, so a child
    process starts JAX's CPU backend with the same XLA_FLAGS: 0.5 s to 1 s, paid only where
    XLA_FLAGS is set, once per value in a process."""
    value = os.environ.get("XLA_FLAGS", "").strip()
    if not value or value in _XLA_FLAGS_READ:
        return
    fix = "fix or unset XLA_FLAGS"
    if not value.startswith("--") and not os.path.isfile(value):
        raise PlatformError(f"XLA_FLAGS={value!r}: expected flags, --name or --name=value (XLA "
                            f"takes a value without a leading -- for a file of flags, and there "
                            f"is no file {value!r}); {fix}")
    if value.startswith("--"):
        try:
            words = shlex.split(value)
        except ValueError as exc:
            raise PlatformError(f"XLA_FLAGS={value!r}: {exc}; expected --name or --name=value "
                                f"flags separated by spaces; {fix}") from None
        stray = [w for w in words if not w.startswith("--")]
        if stray:
            raise PlatformError(f"XLA_FLAGS: {stray[0]!r} is no flag; expected --name or "
                                f"--name=value (a value joins its flag with =); {fix}")
    problem = _xla_flags_problem()
    if problem is not None:
        raise PlatformError(f"XLA_FLAGS: {problem}, and would stop the run as it starts; expected "
                            f"flags this jaxlib's XLA knows, with values of their type; {fix}")
    _XLA_FLAGS_READ.add(value)


def _xla_flags_problem() -> str | None:
    """What XLA says of XLA_FLAGS as JAX starts its CPU backend in a child process; None when it
    starts (or the child cannot tell: no jax, or too slow, and the run finds out itself)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")  # never a TPU: libtpu allows one process
    try:
        child = subprocess.run([sys.executable, "-c", "import jax; jax.devices('cpu')"], env=env,
                               capture_output=True, text=True, timeout=XLA_PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = {level: text.strip() for level, text in reversed(_FLAG_LOG.findall(child.stderr))}
    if child.returncode == 0 or "F" not in lines:
        return None
    unknown = re.match(r"Unknown flags? in XLA_FLAGS: (.*)", lines["F"])
    if unknown:
        if tpu_evidence():  # libtpu may know flags the CPU backend does not: left to the run
            return None
        return f"XLA does not know {unknown.group(1)}"
    said = lines.get("E", lines["F"])
    if said.startswith("Check failed:"):  # "Check failed: tsl::Flags::Parse(...) Flag parsing failed."
        said = said.rsplit(") ", 1)[-1]
    return f"XLA cannot read it ({said.rstrip('.')})"


def check_jax_attention(name: str | None, *, probe: bool = True) -> None:
    """A name the JAX backend knows, and not splash off a TPU: the splash kernel is a Pallas TPU
    kernel, which elsewhere fails at the first compile ("Only interpret mode is supported on CPU
    backend"). Call after check_jax_platforms; `probe` as there (the platform is JAX's answer)."""
    if name is None:
        return
    from modules import ops
    known = list(dict.fromkeys([*ops.implementations("attention"), *JAX_ATTENTION]))
    if name not in known:
        raise PlatformError(f"--attention {name!r}: expected one of {', '.join(known)}")
    if name != "splash" or not probe:
        return
    import jax
    platform = jax.default_backend()
    if platform != "tpu":
        here = sorted({*ops.implementations("attention"), *JAX_ATTENTION} - {"splash"})
        raise PlatformError(f"--attention splash: the splash kernel runs on a TPU only, and this "
                            f"run's JAX platform is {platform}; expected one that runs here: "
                            f"{', '.join(here)} (splash_interpret: the same kernel interpreted, "
                            "slow)")


def check_torch_attention(name: str | None) -> None:
    """The torch backend runs the registered torch implementations of ops.attention only."""
    if name is None:
        return
    from modules import ops
    # the JAX lowerings register themselves too once tpu.attention is imported in this process
    names = [n for n in ops.implementations("attention") if n not in JAX_ATTENTION]
    if name not in names:
        jax_only = " (jax_dpa, splash and splash_interpret are the JAX backend's)" \
            if name in JAX_ATTENTION else ""
        raise PlatformError(f"--attention {name!r}: expected one of {', '.join(names)} with "
                            f"--backend torch{jax_only}")


def torch_devices() -> dict[str, int]:
    """Device type -> count of the torch devices this process can use (cpu always 1)."""
    import torch

    import modules.ops  # noqa: F401 - imports torch_npu where installed, which adds torch.npu
    found = {"cpu": 1}
    if torch.cuda.is_available():
        found["cuda"] = torch.cuda.device_count()
    npu = getattr(torch, "npu", None)  # registered by torch_npu
    if npu is not None and npu.is_available():
        found["npu"] = npu.device_count()
    return found


def check_torch_device(name: str | None) -> None:
    """--device must name a device this host has: cuda, npu or cpu, with an index in range."""
    if name is None:
        return
    import torch
    kind, colon, index = name.strip().lower().partition(":")
    here = torch_devices()
    shown = ", ".join(here)
    if kind not in ("cuda", "npu", "cpu") or (colon and not index.isdigit()):
        raise PlatformError(f"--device {name!r}: expected cuda, npu or cpu (a number after a "
                            f"colon picks one: cuda:1); this host has {shown}")
    if kind not in here:
        if kind == "cuda":
            why = f"torch {torch.__version__} is built without CUDA" if torch.version.cuda is None \
                else "torch.cuda.is_available() is False"
        else:
            why = "torch_npu is not installed" if getattr(torch, "npu", None) is None \
                else "torch.npu.is_available() is False"
        raise PlatformError(f"--device {name}: no {kind} device here ({why}); expected one this "
                            f"host has: {shown}")
    if colon and kind != "cpu" and int(index) >= here[kind]:
        raise PlatformError(f"--device {name}: this host has {here[kind]} {kind} device(s) "
                            f"({kind}:0 to {kind}:{here[kind] - 1})")


def check_backend(backend: str, *, device: str | None = None, attention: str | None = None,
                  multihost: bool = False) -> None:
    """The platform, device and attention a run asks for exist here: checked with the flags,
    before any model work."""
    if backend == "torch":
        check_torch_device(device)
        check_torch_attention(attention)
        return
    # jax.distributed.initialize must come before JAX starts a backend: no probe then
    check_jax_platforms(probe=not multihost)
    check_jax_attention(attention, probe=not multihost)
