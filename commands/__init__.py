"""The commands a user runs, one module each: flags, up-front checks, wiring, progress, reports.

The top room (DESIGN.md): it may import every room below (encoders, sampling, the backends
through `stage2_backend.make_backend`) and nothing below imports it; the top-level scripts only
call its `main`s (tests/test_layering.py checks the arrows).

    stage1.py     prompt (image, audio) -> stage1_embeddings.safetensors + generation_config.json
    stage2.py     stage-1 files -> denoised latents, cached: flags and the run of a RunSpec
                  (sampling/run_spec.py), resolved in stage2_resolve.py; models and backend
                  in stage2_backend.py, the report and summary in stage2_report.py
    stage3.py     latents -> mp4 (VAE decode; patch parallel over torch.distributed)
    generate.py   prompt(s) -> mp4(s): stage 1, 2 and 3 in one process, programs compiled once
    calibrate.py  TeaCache profiles and budget profiles for a model
"""
