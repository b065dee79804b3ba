"""The DiTs (Wan2.2, HunyuanVideo-1.5) as plain torch modules with a staged API.

`wan.py`, `hunyuan_video15.py`: the models (official parameter names, static shapes);
`ops.py`: the dispatch point of each fused-op candidate; `layers.py`: shared small layers;
`registry.py`: named configs and model construction (meta device for shapes only);
`convert.py`: official <-> diffusers keys; `checkpoint.py`: safetensors load and save.
Knows nothing of caching, sharding or device placement (DESIGN.md).
"""
