"""``python -m disteval [overrides]``: see ``disteval.cli`` (the Hydra task lives in an importable module so
that submitit can pickle it by reference).

The first console line goes out before torch and Hydra load (seconds); nothing heavy is imported at module
level, because a process started with multiprocessing's spawn method re-imports this module (as
``__mp_main__``; the local launcher's ranks are forks of a fork server, which does not)."""


def entry() -> None:
    """Console entry point (``python -m disteval`` and the ``disteval`` script): record the process start, say
    what is happening, then import and run the CLI."""
    import sys

    from disteval.common import startup

    startup.mark_process_start()
    if not startup.info_request(sys.argv[1:]):
        startup.progress("starting: importing torch and Hydra, then composing the config")
    from disteval.cli import main

    try:
        main()
    except SystemExit as exc:
        code = exc.code
    else:
        code = 0
    if code is None or isinstance(code, int):  # what the run left to do is done: skip the module teardown
        startup.exit_without_teardown(code or 0)
    sys.exit(code)


if __name__ == "__main__":
    entry()
