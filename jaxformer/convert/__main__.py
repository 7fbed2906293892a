"""`python -m jaxformer.convert`."""

from jaxformer.convert.cli import main

main()
