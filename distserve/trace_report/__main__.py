"""`python -m distserve.trace_report SPANS ...`: the same as `distserve trace-report`."""

import sys

from distserve.trace_report import main

sys.exit(main())
