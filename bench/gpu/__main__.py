"""`python -m bench.gpu`: the prepared GPU command (bench/gpu/run.py)."""

import sys

from bench.gpu.run import main

sys.exit(main())
