"""The prepared GPU command, `python -m bench.gpu`: the JAX and torch backends on CUDA at real
size, beside diffusers on the same card.

    run.py             the phases and the command (`python -m bench.gpu` runs its main)
    plan.py            what the timing phases run and cost, by arithmetic (`--plan_only`)
    adapter.py         the adapter phase: our gate inside diffusers' WanPipeline
    verdicts.py        the results read as verdicts
    page.py            bench/results/gpu.md and gpu.json
    torch_wan_step.py  the real-size Wan2.2 step on one GPU, ours beside diffusers' (the torch
                       phase's helpers; alone: `python -m bench.gpu.torch_wan_step`)
"""
