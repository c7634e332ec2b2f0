"""`python -m dataflow.bench.sweep` is `dataflow-sweep`. Never holds logic of its own."""

import sys

from dataflow.bench.sweep.cli import main

sys.exit(main())
