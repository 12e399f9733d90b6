import sys

from flexplan.cli import main

sys.exit(main())
