"""``python -m flashlab.bench``: see ``flashlab.bench.cli``."""

from flashlab.bench.cli import main

main()
