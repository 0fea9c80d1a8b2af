"""``python -m nexusctl.cli``: the same as the ``nexusctl`` console script."""

from nexusctl.cli import main

if __name__ == "__main__":
    main()
