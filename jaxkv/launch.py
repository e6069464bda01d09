"""``python -m jaxkv.launch``: start a multi-process jaxkv job (``--help`` says how; the
launcher itself is jaxkv/_src/processes/launcher.py)."""

import sys

from jaxkv._src.processes.launcher import HUGETLB_MALLOC as HUGETLB_MALLOC
from jaxkv._src.processes.launcher import Launcher as Launcher
from jaxkv._src.processes.launcher import launch as launch
from jaxkv._src.processes.launcher import main as main
from jaxkv._src.processes.launcher import process_env as process_env

__all__ = ["HUGETLB_MALLOC", "Launcher", "launch", "main", "process_env"]

if __name__ == "__main__":
    sys.exit(main())
