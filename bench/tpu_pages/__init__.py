"""The Cloud TPU pages, made on this CPU machine: what the real-size jobs compile to and cost per
slice, and how their weights load.

    aot.py          real-size pipelines compiled per slice: bench/results/tpu_aot.md
                    (`python -m bench.tpu_pages.aot`); the stage-3 decode rows in aot_decode.py,
                    the kept compile reports and shared cells in aot_reports.py
    whole_job.py    the whole job per pipeline and slice: bench/results/whole_job.md
                    (`python -m bench.tpu_pages.whole_job`); stage 1's work in stage1_work.py
    load.py         a real-size checkpoint onto 8 emulated devices through the JAX backend's
                    sharded loader: bench/results/load.md (`python -m bench.tpu_pages.load`)
"""
