"""``python -m disteval.rescore STORE [OVERRIDES...]``: the entry point of re-scoring a prediction store
(``disteval.driver.rescore``, where it lives with the rest of the driver)."""
import sys

from disteval.driver.rescore import main

if __name__ == "__main__":
    sys.exit(main())
