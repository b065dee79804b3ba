"""Stage 2's models and backend: loading the weights (whole models, or checkpoints opened for the
JAX backend to read a slice at a time), the backend the launch settings ask for, and the checks
that need the models or the backend (profile fingerprints, host memory)."""

from __future__ import annotations

import json

import torch

from modules import ops
from modules.checkpoint import cast_model, load_model, open_checkpoint
from modules.registry import build_model
from sampling.calibration import recorded_weights
from sampling.errors import UsageError
from sampling.run_spec import Launch, RunSpec, expert_path, gib, hidden_bytes


def check_host_memory(spec: RunSpec, backend) -> None:
    """On the host CPU, refuse a size whose attention would not fit in the memory there (JAX's
    CPU attention holds every score; torch's CPU kernels stream them), before any compile."""
    if backend.platform() != "cpu":
        return
    pipe, tokens = spec.pipe, spec.tokens
    heads = pipe.config.num_heads
    batch = 2 if spec.config.cfg_mode == "fused" else 1
    scores = batch * heads * tokens ** 2 * 4 if spec.launch.backend == "jax" else 0
    need = scores + 12 * batch * hidden_bytes(pipe, tokens)  # a block's working set
    free = _available_memory()
    if free is not None and need > free:
        h, w, f = spec.size
        raise UsageError(f"--height {h} --width {w} --video_length {f}: {tokens:,} tokens need "
                         f"about {gib(need)} on the host CPU ({gib(scores)} of attention "
                         f"scores); this host has {gib(free)} available: expected a smaller "
                         "size")


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def load_models(pipe, model_path, dtype, seed: int = 0) -> dict:
    """expert -> model: from the checkpoint(s), or tiny random weights drawn from a fixed seed."""
    models = {}
    if model_path is None and pipe.builtin_path is not None:
        model_path = pipe.builtin_path
    for i, (expert, name) in enumerate(pipe.experts):
        if model_path is None:
            torch.manual_seed(seed + i)
            models[expert] = cast_model(build_model(name), dtype)
        else:
            models[expert], _ = load_model(expert_path(pipe, model_path, expert), name, dtype=dtype)
    return models


def open_models(pipe, model_path, dtype) -> dict:
    """expert -> (model on the meta device, reader of its checkpoint): every check of a load
    (headers, keys, shapes) now, the weights later, read by the JAX backend a slice at a time
    (each host only the rows its devices keep)."""
    opened = {}
    try:
        for expert, name in pipe.experts:
            model, reader, _ = open_checkpoint(expert_path(pipe, model_path, expert), name,
                                               dtype=dtype)
            opened[expert] = (model, reader)
    except BaseException:
        for _, reader in opened.values():
            reader.close()
        raise
    return opened


def _torch_device(name):
    if name:
        return name
    if torch.cuda.is_available():
        return "cuda"
    npu = getattr(torch, "npu", None)
    return "npu" if npu is not None and npu.is_available() else "cpu"


def torch_parallel(launch: Launch):
    """This rank's layout when run under torchrun with --sp_size/--cfg_parallel (torch backend);
    None for one process. A world that is not sp x cfg ranks stops here, before any loading."""
    if launch.backend != "torch":
        return None
    from sharding.torch_sp import init_torch_parallel
    try:
        return init_torch_parallel(launch.sp_size, launch.cfg_parallel, device=launch.device)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def backend_writer(multihost: bool) -> bool:
    """Whether this process writes and prints: all but process 0 of a multi-host job stay quiet."""
    if not multihost:
        return True
    from tpu.distributed import is_writer
    return is_writer()


def make_backend(launch: Launch, models, plan, layout=None, checkpoints=None):
    """The backend `launch` asks for. The torch path never imports torchax: torchax renames
    torch's private device to 'jax', which breaks torch.compile in the same process.
    checkpoints (JAX): expert -> reader its weights are read from (`open_models`)."""
    if launch.backend == "torch":
        from torch_backend.backend import TorchBackend
        if launch.attention:
            ops.select(attention=launch.attention)
        device = layout.device if layout is not None else _torch_device(launch.device)
        return TorchBackend(models, plan, device, compile=launch.torch_compile,
                            offload_model=launch.offload_model, layout=layout)
    from tpu.compile import cache_dir_of, enable_compile_cache
    # before tpu.backend is imported: importing torchax already compiles (its random key)
    enable_compile_cache(cache_dir_of(launch.compile_cache_dir))
    from tpu.backend import JaxBackend
    mesh = None
    if launch.sp_size > 1 or launch.cfg_parallel or launch.multihost:
        from sharding.jax_sp import make_mesh
        try:
            mesh = make_mesh(launch.sp_size, 2 if launch.cfg_parallel else 1)
        except ValueError as exc:
            raise UsageError(f"--sp_size {launch.sp_size}"
                             f"{' --cfg_parallel' if launch.cfg_parallel else ''}: {exc}") from None
    return JaxBackend(models, plan, attention_impl=launch.attention, mesh=mesh,
                      weights=launch.weight_sharding, checkpoints=checkpoints)


def check_profile_weights(spec: RunSpec, fingerprints_of) -> list[str]:
    """Refuse a calibrated profile measured on other weights than these (unless
    --accept_profile); warnings for a profile that records none (written before it did).
    `fingerprints_of()` -> expert -> fingerprint, asked only when a profile file is in use."""
    files = spec.profile_files
    if not files:
        return []
    notes = []
    fingerprints = fingerprints_of()
    for flag, path, recorded in recorded_weights(files, fingerprints):
        if recorded is None:
            notes.append(f"{flag} {path} records no weights fingerprint (calibrated before "
                         "profiles did); it is used as if measured on these weights")
        elif not spec.accept_profile:
            theirs = json.loads(json.dumps(fingerprints))
            raise UsageError(f"{flag} {path} was calibrated on other weights (fingerprint "
                             f"{recorded}, these are {theirs}); calibrate on these weights, "
                             "or pass --accept_profile to use it anyway")
        else:
            notes.append(f"{flag} {path} was calibrated on other weights; used as asked "
                         "(--accept_profile)")
    return notes
