"""Run as its own process by tests/test_diffusers_adapter.py: torch.compile fails in a process
that imported torchax (it renames torch's private device; commands/stage2_backend.make_backend),
which another test in a shared pytest worker may have done. Prints the figures as JSON."""

from __future__ import annotations

import json

import torch
from torch._dynamo.utils import counters

from adapters.diffusers import cache_report, enable_cache
from tests.diffusers_pipelines import wan_case


def main() -> None:
    wan = wan_case()
    pipe = wan.make()
    enable_cache(pipe, teacache=True, teacache_thresh=0.05, compile=True)
    seen = []

    def count(_pipe, i, t, kwargs):
        seen.append(counters["frames"]["ok"])
        return kwargs
    before = counters["frames"]["ok"]
    first = wan.call(pipe, callback_on_step_end=count)
    compiled_trace = cache_report(pipe)["trace"]
    reported = cache_report(pipe)["compiled_graphs"]
    again = wan.call(pipe)
    after_second = counters["frames"]["ok"]
    eager = wan.make()
    enable_cache(eager, teacache=True, teacache_thresh=0.05)
    eager_out = wan.call(eager)
    same = [(r["step"], r["branch"], r["action"]) for r in compiled_trace] == [
        (r["step"], r["branch"], r["action"]) for r in cache_report(eager)["trace"]]
    print(json.dumps({"before": before, "per_step": seen, "reported": reported,
                      "after_second": after_second, "second_equal": torch.equal(again, first),
                      "eager_diff": float((eager_out - first).abs().max()), "same_trace": same}))


if __name__ == "__main__":
    main()
