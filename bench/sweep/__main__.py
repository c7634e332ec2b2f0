"""`python -m bench.sweep` is `dataflow-sweep`. Never holds logic of its own."""

import sys

from bench.sweep.cli import main

sys.exit(main())
