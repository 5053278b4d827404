"""``python -m benchmarks.gpu_check``: see ``README.md``."""

import sys

from benchmarks.gpu_check.run import main

if __name__ == "__main__":
    sys.exit(main())
