import sys

from trainguard.cli import main

sys.exit(main())
