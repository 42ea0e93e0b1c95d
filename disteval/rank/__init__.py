"""The rank: one process of a run. ``bootstrap`` joins the process group and builds the model; ``engine``
evaluates the rank's shard (``loop``), synchronises the metric states (``sync``) and writes the rank's records;
``canary``, ``predictions``, ``model_set``, ``parallel``, ``watchdog``, ``peers`` and ``resume`` are its parts.
Imported by the launchers (which start ranks) and the doctor, never by the driver."""
