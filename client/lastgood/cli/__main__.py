"""`python -m lastgood.cli ...`: the same as the `lastgood` console script."""

from lastgood.cli import main

if __name__ == "__main__":
    main()
