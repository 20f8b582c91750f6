"""python -m minimal_asymloop.experiments: see the package's docstring (or --help)."""

from minimal_asymloop.experiments import main

main()
