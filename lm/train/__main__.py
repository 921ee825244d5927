"""`python -m lm.train ...` = `lm train ...` (what `deepspeed`/`torchrun` launch on every rank)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
