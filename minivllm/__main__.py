"""`python -m minivllm ...` is the `minivllm` command."""

import sys

from minivllm.entrypoints.cli import main

sys.exit(main())
