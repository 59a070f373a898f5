import sys

from dispatch.cli import main

sys.exit(main())
