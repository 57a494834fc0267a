import sys

from sparsegen.cli import main

sys.exit(main())
