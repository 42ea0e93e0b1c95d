"""disteval's doctor: reads a run's records, walks the troubleshooting flowchart as a state machine
(INIT -> SHARDS -> CONVERGENCE -> COMM -> RESULT), names the failing state with its evidence and remedy,
and can probe and retry. ``python -m diagnostics doctor RUN_DIR``. Nothing in disteval imports this package.
"""
