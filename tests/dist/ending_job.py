"""Run by tests/test_launch_cause.py under ``python -m jaxkv.launch -n 2``, without JAX: rank 1
begins to exit and ends 1.5 s later, with status 3; rank 0 sees it go and fails (status 1), and
ends first. So a peer whose collective failed because a process had gone can end before that
process does (a large process takes a while to exit). The launcher must name rank 1.

    ending_job.py DIR
"""

import ctypes
import os
import sys
import threading
import time

#: The exit system call, which ends the calling thread only (os._exit ends them all).
SYS_EXIT = {"x86_64": 60, "aarch64": 93}

directory = sys.argv[1]
if os.environ["JAXKV_PROCESS_ID"] == "1":

    def end_later():
        time.sleep(1.5)
        os._exit(3)

    threading.Thread(target=end_later).start()
    open(os.path.join(directory, "ending"), "w").close()
    # The main thread exits: /proc/PID/stat shows the process exiting (a zombie leader), but it
    # ends, and the launcher sees it end, only when its last thread does.
    ctypes.CDLL(None).syscall(SYS_EXIT[os.uname().machine], 0)
while not os.path.exists(os.path.join(directory, "ending")):
    time.sleep(0.01)
time.sleep(0.2)
sys.exit(1)
