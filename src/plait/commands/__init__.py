"""One module per ``plait`` verb: ``train``, ``generate``, ``export``, ``checkpoint``,
``report``, ``info``, ``simulate``, ``plan``, ``calibrate``, ``viz``, ``rehearse``. Each has
``add_parser(sub)``, which adds its subparser to the one ``plait.cli`` builds, and
``run(args, parser)``, which runs it from the parsed arguments (``parser``: its own
subparser, whose flags are the keys a ``--config`` file may hold) and returns the exit
code. The work is in the library (``plait.train``, ``plait.sim``, ``plait.viz`` ...);
``common.py`` holds what several verbs share (the one-line error, ``--config`` files),
``plait.cli_args`` the model, layout, LoRA and data-parallel flags."""
