"""``python -m concept_cli`` is the same as the ``concept`` console script."""
from .main import main

main()
