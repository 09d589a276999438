"""`python -m bench [--quick] [--json PATH]`."""
import sys

from bench.run import main

sys.exit(main())
