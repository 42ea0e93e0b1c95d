"""``python -m disteval [overrides]``: see ``disteval.driver.cli`` (the Hydra task lives in an importable module so
that a launcher can pickle it by reference).

The first console line goes out before torch and Hydra load (seconds); nothing heavy is imported at module
level, because a process started with multiprocessing's spawn method re-imports this module (as
``__mp_main__``; the local launcher's ranks are forks of a fork server, which does not)."""


def entry() -> None:
    """Console entry point (``python -m disteval`` and the ``disteval`` script): record the process start, say
    what is happening, then import and run the CLI."""
    import sys

    from disteval.common import startup

    startup.mark_process_start()
    try:
        if not startup.info_request(sys.argv[1:]):
            startup.progress("starting: importing torch and Hydra, then composing the config")
        from disteval.driver.cli import main

        main()
    except SystemExit as exc:
        code = exc.code
    except KeyboardInterrupt:  # Ctrl-C before the run could handle it (imports, composing, checks): one line
        print("disteval: interrupted (SIGINT) before the run started; nothing was run", file=sys.stderr, flush=True)
        code = 130  # as shells report a death by SIGINT: 128 + 2
    else:
        code = 0
    if code is None or isinstance(code, int):  # what the run left to do is done: skip the module teardown
        startup.exit_without_teardown(code or 0)
    sys.exit(code)


if __name__ == "__main__":
    entry()
