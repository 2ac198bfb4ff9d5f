import sys

from fl_lightning.cli import main

if __name__ == "__main__":
    sys.exit(main())
