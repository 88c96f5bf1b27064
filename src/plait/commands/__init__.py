"""Front ends of the commands that are not training: ``plait simulate`` (``simulate.py``),
``plait plan`` (``plan.py``) and ``plait calibrate`` (``calibrate.py``). Each adds its
flags to the parser ``plait.cli`` builds and runs from the parsed arguments; the work is
in ``plait.sim`` and ``plait.calibrate``."""
