import os
import sys

from dispatch.cli.commands import main

# Usage names the program as it was typed: `python3 -m dispatch`, not the console script's `dispatch`.
sys.exit(main(prog=f"{os.path.basename(sys.orig_argv[0])} -m dispatch"))
