"""`python -m eyas` (and `torchrun -m eyas`) runs the CLI."""

from eyas.cli import main

if __name__ == "__main__":
    main()
