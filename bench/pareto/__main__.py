"""`python -m bench.pareto`: the pareto bench's command (bench/pareto/run.py)."""

import sys

from bench.pareto.run import main

sys.exit(main())
