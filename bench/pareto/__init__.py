"""The pareto bench, `python -m bench.pareto`: fidelity against speed, our caching beside
diffusers' cache hooks and cache-dit on the same weights.

    run.py       the menu of methods and the command (`python -m bench.pareto` runs its main)
    workload.py  the tiny models, their draws, the block counter, our runs on the torch backend
    peers.py     the peers as installed libraries (diffusers' hooks, cache-dit, the adapter)
    budget.py    budgeted mode: the targets, the calibration, the chosen configurations
    report.py    the standing against the peers, the tables and plots
    page.py      the results page and its notes
    restand.py   the committed pages read again under today's rules (`python -m bench.pareto.restand`)
"""
