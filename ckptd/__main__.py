import sys

from ckptd.cli import main

sys.exit(main())
