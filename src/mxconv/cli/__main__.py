"""``python -m mxconv.cli``."""

from mxconv.cli import main

main()
