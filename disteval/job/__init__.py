"""The job: what the driver and the launchers share. ``preflight`` checks a run before any rank starts,
``rundir`` owns the run directory, ``records`` the records' contract (status, results, launch), ``report``,
``run_report``, ``driverlog``, ``htmlreport`` and ``sweep`` present them. Never imports a rank's module."""
