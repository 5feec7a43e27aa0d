"""Run a script with ``--local_rank=$LOCAL_RANK`` appended to its arguments, as DeepSpeed's
launcher passes it: ``zero-launch -n 2 python with_local_rank.py SCRIPT ARGS...``.

zero-launch sets LOCAL_RANK in each rank's environment but passes no ``--local_rank``
(issue 46, trap 7); scripts written for DeepSpeed read ``args.local_rank`` and, left at
-1, take their single-process path. This shim stands in until zero-launch passes it.
"""

import os
import runpy
import sys

if __name__ == "__main__":
    script, *arguments = sys.argv[1:]
    sys.argv = [script, *arguments, f"--local_rank={os.environ['LOCAL_RANK']}"]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
