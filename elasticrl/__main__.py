import sys

from elasticrl.cli import main

sys.exit(main())
