"""The DiTs (Wan2.2, HunyuanVideo-1.5) as plain torch modules with a staged API.

`wan.py`, `hunyuan_video15.py`: the models (official parameter names, static shapes);
`ops.py`: the dispatch point of each fused-op candidate; `layers.py`: shared small layers;
`registry.py`: named configs, model construction (meta device for shapes only) and each
family's checkpoint format; `wan_format.py`, `wan_s2v_format.py`, `hunyuan_video15_format.py`:
those formats (config.json vocabularies, official <-> diffusers keys), written with the parts in
`layouts.py`; `convert.py`: key conversion by family name; `safetensors_reader.py`: checkpoint
files, strict headers, tensor and row reads; `checkpoint.py`: checked load, sliced open, save.
Knows nothing of caching, sharding or device placement (DESIGN.md).
"""
