"""`python -m captioning ...`: the `captioning` command (`captioning.cli.main`, the console
script of pyproject.toml's [project.scripts])."""

import sys

from captioning.cli import main

if __name__ == "__main__":
    sys.exit(main())
