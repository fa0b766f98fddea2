import sys

from fastft.cli import main

sys.exit(main())
