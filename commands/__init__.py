"""The commands a user runs, one module each: flags, up-front checks, wiring, progress, reports.

The top room (DESIGN.md): it may import every room below (encoders, sampling, the backends
through sampling) and nothing imports it; the top-level scripts only call its `main`s.

    stage1.py    prompt (image, audio) -> stage1_embeddings.safetensors + generation_config.json
    generate.py  prompt(s) -> mp4(s): stage 1, 2 and 3 in one process, programs compiled once
"""
