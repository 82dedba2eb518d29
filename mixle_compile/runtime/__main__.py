import os
import sys

from mixle_compile.runtime import main

code = main()
sys.stdout.flush()
sys.stderr.flush()
# The process group is already destroyed; skipping the interpreter's teardown keeps a communication
# thread that is still winding down from aborting a rank that has finished its work.
os._exit(code)
