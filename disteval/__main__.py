"""``python -m disteval [overrides]``: see ``disteval.cli`` (the Hydra task lives in an importable module so
that submitit can pickle it by reference)."""
from disteval.cli import main

if __name__ == "__main__":
    main()
