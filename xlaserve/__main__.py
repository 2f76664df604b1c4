import sys

from xlaserve.cli import main

sys.exit(main())
