"""``python -m jaxkv.launch``: start a multi-process jaxkv job (the launcher itself is
jaxkv/_src/processes/launcher.py; its docstring, which ``--help`` prints, is this module's)."""

import sys

from jaxkv._src.processes import launcher as _launcher
from jaxkv._src.processes.launcher import HUGETLB_MALLOC as HUGETLB_MALLOC
from jaxkv._src.processes.launcher import Launcher as Launcher
from jaxkv._src.processes.launcher import launch as launch
from jaxkv._src.processes.launcher import main as main
from jaxkv._src.processes.launcher import process_env as process_env

__all__ = ["HUGETLB_MALLOC", "Launcher", "launch", "main", "process_env"]
__doc__ = _launcher.__doc__

if __name__ == "__main__":
    sys.exit(main())
