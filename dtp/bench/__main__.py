"""`python -m dtp.bench ...` is `dtp bench ...`."""

import sys

from dtp.bench.run import main

sys.exit(main())
