"""The driver: the command line (``cli``, ``python -m disteval``), re-scoring (``rescore``) and the trackers
(``loggers``). Composes and checks the configuration, hands the run to a launcher and presents its records;
imports no module of a rank's own."""
