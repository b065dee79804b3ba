"""The benches behind bench/results/ and docs/results.md, one package a part:

    pareto/      the pareto bench, `python -m bench.pareto`: our caching beside diffusers' cache
                 hooks and cache-dit on the same weights (workload, peers, budgeted mode, report,
                 page; `python -m bench.pareto.restand` reads the committed pages again)
    tpu_pages/   the Cloud TPU pages: real-size compiles per slice (`python -m bench.tpu_pages.aot`),
                 the whole job per pipeline and slice (`.whole_job`, stage 1's work counted in
                 `.stage1_work`), and the JAX backend's sharded checkpoint loading (`.load`)
    gpu/         the prepared GPU command, `python -m bench.gpu`, and the torch step bench it
                 runs (`python -m bench.gpu.torch_wan_step`)
    fixtures/    the tiny trained models: clips, scenes, training and evaluation
    studies/     the small studies, one command each: `python -m bench.studies.<name>`
    page.py      what every results page shares (machine, versions, command line, writers)
    workload.py  random-weight models made smooth in t (the pareto bench's and the studies')
"""
